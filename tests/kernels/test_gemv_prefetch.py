"""The gemv kernels' L2 prefetch epilogue (``l2_prefetch=``, ``--decode-l2-prefetch-mib``).

A prefetch changes where later reads find their bytes, never what a kernel computes: with it,
every result must equal, bit for bit, the same kernel without it, eagerly and replayed from a
CUDA graph, and the engine's greedy tokens must not change. Where it cannot run (a CPU, the
interpreter, a GPU before Hopper) it is refused with an error naming the flag.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.engine import Engine
from app.engine.builder import resolve_decode_l2_prefetch
from app.engine.config import MAX_L2_PREFETCH_MIB, EngineConfig
from app.engine.make_checkpoint import ModelSpec, make_checkpoint
from app.engine.model_config import ModelConfig
from app.engine.models import build_model
from app.ipc.messages import SamplingParams
from app.kernels.triton_gemv import gemv, gemv_add_rms_norm
from app.server_args import parse_server_args

HIDDEN, INTERMEDIATE = 2048, 8192  # Llama-3.2-1B's layer shapes
SPEC = ModelSpec(architecture="LlamaForCausalLM", num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4,
                 num_kv_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=512, rope_theta=10000.0,
                 rms_norm_eps=1e-5, seed=3)


def test_prefetch_is_refused_where_it_cannot_run() -> None:
    cpu = torch.device("cpu")
    x, w = torch.zeros(1, 64), torch.zeros(32, 64)
    with pytest.raises(ValueError, match="gemv: l2_prefetch runs on the FMA path on a CUDA device"):
        gemv(x, w, l2_prefetch=(w.view(-1),))
    with pytest.raises(ValueError, match="gemv: l2_prefetch takes at most two ranges, got 3"):
        gemv(x, w, l2_prefetch=(w.view(-1),) * 3)
    assert resolve_decode_l2_prefetch(0.0, cpu, fused_decode=False) == 0  # the default: off, anywhere
    with pytest.raises(ValueError, match="--decode-l2-prefetch-mib needs --fused-decode on"):
        resolve_decode_l2_prefetch(8.0, cpu, fused_decode=False)
    with pytest.raises(ValueError, match="--decode-l2-prefetch-mib needs a CUDA device of compute capability 9.0 "
                                         "or newer; here: a CPU"):
        resolve_decode_l2_prefetch(8.0, cpu, fused_decode=True)
    assert parse_server_args([]).decode_l2_prefetch_mib == 0.0 == EngineConfig(model_path=".").decode_l2_prefetch_mib
    assert parse_server_args(["--decode-l2-prefetch-mib", "16"]).engine_config(".").decode_l2_prefetch_mib == 16.0
    for bad in (-1.0, MAX_L2_PREFETCH_MIB + 1.0):
        with pytest.raises(ValueError, match=rf"--decode-l2-prefetch-mib must be in \[0, {MAX_L2_PREFETCH_MIB}\]"):
            EngineConfig(model_path=".", decode_l2_prefetch_mib=bad).validate()


def test_the_weights_after_qkv_are_o_then_the_head_of_gate_up(tmp_path: Path) -> None:
    """What a layer hands its qkv gemv to prefetch: o_proj's weight first, then as much of
    gate_up_proj's as the limit leaves, each cut to whole 256-byte blocks."""
    model = build_model(ModelConfig.from_pretrained(make_checkpoint(tmp_path / "model", SPEC)),
                        dtype=torch.bfloat16, device="meta")
    layer = model.layers[0]
    o, gate_up = layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight
    o_bytes = o.numel() * 2
    assert o_bytes == 256 * 256 * 2

    def lengths(limit: int) -> list[int]:
        return [r.numel() * r.element_size() for r in layer.weights_after_qkv(limit)]

    assert lengths(1000) == [768]  # within o, whole blocks only
    assert lengths(100) == []  # less than a block: nothing
    assert lengths(o_bytes) == [o_bytes]
    assert lengths(o_bytes + 300) == [o_bytes, 256]
    assert lengths(10**9) == [o_bytes, gate_up.numel() * 2]  # both whole, no more
    first, second = layer.weights_after_qkv(o_bytes + 512)
    assert first.shape == (o.numel(),) and second.shape == (256,)


def _random(shape: tuple[int, ...], seed: int, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16).to(device)


@pytest.mark.gpu
def test_prefetch_leaves_every_result_unchanged_eager_and_in_a_graph(device: torch.device) -> None:
    if torch.cuda.get_device_capability(device) < (9, 0):
        pytest.skip("the bulk L2 prefetch needs compute capability 9.0")
    qkv_w = _random((3072, HIDDEN), 1, device, HIDDEN**-0.5)
    o_w = _random((HIDDEN, HIDDEN), 2, device, HIDDEN**-0.5)
    gate_up_w = _random((2 * INTERMEDIATE, HIDDEN), 3, device, HIDDEN**-0.5)
    norm = 1 + _random((HIDDEN,), 4, device, 0.1)
    x, residual = torch.zeros(1, HIDDEN, dtype=torch.bfloat16, device=device), _random((1, HIDDEN), 5, device)
    odd = _random((4 * 1000 + 8,), 6, device)  # a length that no grid divides evenly

    def chain(prefetch: bool) -> list[torch.Tensor]:
        ranges = (o_w.view(-1), gate_up_w.view(-1)[: 5 * 2**20 // 2]) if prefetch else ()
        qkv, h = gemv_add_rms_norm(x, residual, norm, 1e-5, qkv_w, l2_prefetch=ranges)
        o = gemv(qkv[:, :HIDDEN], o_w, l2_prefetch=(odd,) if prefetch else ())
        act, h2 = gemv_add_rms_norm(o, h, norm, 1e-5, gate_up_w, silu_mul=True, l2_prefetch=ranges[:1])
        return [qkv, h, o, act, h2]

    x.copy_(_random((1, HIDDEN), 7, device))
    expected = chain(False)
    assert all(torch.equal(a, b) for a, b in zip(chain(True), expected, strict=True))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(True)
    for seed in range(8, 11):  # fresh inputs each replay
        x.copy_(_random((1, HIDDEN), seed, device))
        graph.replay()
        assert all(torch.equal(a, b) for a, b in zip(outs, chain(False), strict=True))
    assert not torch.equal(outs[0], expected[0])


@pytest.mark.gpu
def test_engine_greedy_tokens_are_the_same_with_the_prefetch(tmp_path: Path) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bulk L2 prefetch needs compute capability 9.0")
    checkpoint = make_checkpoint(tmp_path / "model", SPEC)
    common = dict(max_total_tokens=2048, max_running_requests=2, cuda_graph_max_bs=2)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [[7, 300, 41, 999, 12]]
    expected = Engine(str(checkpoint), **common).generate(input_ids=prompt, sampling_params=params)
    engine = Engine(str(checkpoint), decode_l2_prefetch_mib=1.0, **common)
    assert engine.built.fused_decode and engine.built.decode_l2_prefetch_mib == 1.0
    assert engine.scheduler.runner.model.decode_kernels.l2_prefetch_bytes == 2**20
    got = engine.generate(input_ids=prompt, sampling_params=params)
    assert got[0].token_ids == expected[0].token_ids and len(got[0].token_ids) == params.max_new_tokens
