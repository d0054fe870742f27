"""The one-token MLP in one kernel (app/kernels/triton_fused_mlp.py, ``fused-mlp``) against a float64
reference of ``down(silu(gate) * up)`` of ``rms_norm(x + residual)``, at tiles of one and two
activations, with and without a residual, with a float32 x over weights of another dtype (its
own output fed back); the buffer it zeroes, the residual it returns; then through the engine: the
greedy tokens of batch-1 generation with and without it (an odd number of layers, so that the
last layer takes the third sum buffer), and on a GPU inside the batch-1 CUDA graph in bf16."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import REL_TOL, rel_err

from app.engine import Engine
from app.engine.builder import model_bytes
from app.engine.kernel_plan import KernelOptions, follows_fused_decode
from app.engine.kernel_specs import DEFAULT_PDL_MODE, PLAIN_MLP_PDL_MODE, FusedMlpKnobs
from app.engine.make_checkpoint import ModelSpec, make_checkpoint
from app.ipc.messages import SamplingParams
from app.kernels.triton_fused_mlp import FusedMlpConfig, down_transposed, even_programs, fused_mlp
from app.server_args import parse_server_args


def reference(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the MLP's output in float64, x + residual rounded to the weights' dtype)."""
    h = x.double() + (residual.double() if residual is not None else 0.0)
    h_rounded = h.to(gate_up.dtype)
    h = h_rounded.double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    gate, up = (normed @ gate_up.double().T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.double().T, h_rounded


def make_inputs(k: int, intermediate: int, dtype: torch.dtype, device: torch.device, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)
    x, residual = randn(1, k), randn(1, k)
    norm_weight = (torch.rand(k, generator=gen) + 0.5).to(dtype=dtype, device=device)
    return x, residual, norm_weight, randn(2 * intermediate, k, scale=k ** -0.5), randn(k, intermediate,
                                                                                          scale=intermediate ** -0.5)


@pytest.mark.parametrize("block_n", [2, 4])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
@pytest.mark.parametrize("early_tile", [False, True], ids=["", "early-tile"])
def test_fused_mlp_matches_the_reference(block_n: int, with_residual: bool, early_tile: bool,
                                         device: torch.device) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k, intermediate = 64, 96
    x, residual, norm_weight, gate_up, down = make_inputs(k, intermediate, dtype, device, seed=block_n)
    residual = residual if with_residual else None
    out = torch.zeros(1, k, dtype=torch.float32, device=device)
    zero = torch.full((1, k), float("nan"), dtype=torch.float32, device=device)
    # Few programs an SM: every program walks several tiles (one an SM: one program).
    config = FusedMlpConfig(block_n=block_n, programs_per_sm=1, early_tile=early_tile)
    got, new_residual = fused_mlp(x, residual, norm_weight, 1e-5, gate_up, down_transposed(down), out, zero=zero,
                                  config=config)
    want, h = reference(x, residual, norm_weight, 1e-5, gate_up, down)
    assert got is out and got.dtype == torch.float32
    err = rel_err(got, want)
    assert err <= REL_TOL[dtype], f"relative error {err:.3g}"
    assert torch.equal(new_residual, h) if with_residual else new_residual is x
    assert torch.equal(zero, torch.zeros_like(zero))


def test_float32_x_over_other_weights_sums_into_the_buffer(device: torch.device) -> None:
    """x as a float32 sum (the previous layer's output), and out already holding a part: the
    kernel adds to it (atomics), as the model's sums start from zero."""
    if device.type != "cuda":
        pytest.skip("bf16 weights: the interpreter's cases are float32 (x and weights of one dtype)")
    dtype, k, intermediate = torch.bfloat16, 128, 256
    x, residual, norm_weight, gate_up, down = make_inputs(k, intermediate, dtype, device, seed=5)
    x32 = x.float() * 1.5
    base = torch.randn(1, k, device=device)
    out = base.clone()
    got, _ = fused_mlp(x32, residual, norm_weight, 1e-5, gate_up, down_transposed(down), out)
    want, _ = reference(x32, residual, norm_weight, 1e-5, gate_up, down)
    assert rel_err(got - base, want) <= REL_TOL[dtype]


def test_fused_mlp_rejects_what_does_not_fit(device: torch.device) -> None:
    x, residual, norm_weight, gate_up, down = make_inputs(64, 96, torch.float32, device, seed=1)
    out = torch.zeros(1, 64, device=device)
    down_t = down_transposed(down)
    with pytest.raises(ValueError, match="fused_mlp: zero must be another buffer than out"):
        fused_mlp(x, residual, norm_weight, 1e-5, gate_up, down_t, out, zero=out)
    with pytest.raises(ValueError, match=r"fused_mlp: gate_up \[2I, K\] and down transposed \[I, K\]"):
        fused_mlp(x, residual, norm_weight, 1e-5, gate_up, down, out)
    with pytest.raises(ValueError, match=r"fused_mlp: out must be a contiguous \[1, 64\] float32"):
        fused_mlp(x, residual, norm_weight, 1e-5, gate_up, down_t, out.double())
    with pytest.raises(ValueError, match="intermediate 96 do not fit"):
        fused_mlp(x, residual, norm_weight, 1e-5, gate_up, down_t, out, config=FusedMlpConfig(block_n=128))
    if device.type != "cuda":
        with pytest.raises(ValueError, match=r"fused_mlp: trigger and dependent \(programmatic dependent launch\) "
                                             "need a CUDA device, got cpu"):
            fused_mlp(x, residual, norm_weight, 1e-5, gate_up, down_t, out, dependent=True)
        with pytest.raises(ValueError, match="fused_mlp: probe needs a CUDA device, got cpu"):
            fused_mlp(x, residual, norm_weight, 1e-5, gate_up, down_t, out, probe=torch.zeros(64, dtype=torch.int64))


def test_the_option_parses_and_resolves() -> None:
    """fused-mlp: auto by default, which follows fused-decode; on, it needs that."""
    def options(*argv: str) -> KernelOptions:
        return parse_server_args(list(argv)).engine_config(".").options

    assert KernelOptions().fused_mlp is None and options().fused_mlp is None
    assert follows_fused_decode(None, True, "fused-mlp") and not follows_fused_decode(None, False, "fused-mlp")
    assert options("--kernel-options", "fused-mlp=off").fused_mlp is False
    assert options("--kernel-options", "fused-mlp=on").fused_mlp is True
    assert follows_fused_decode(True, True, "fused-mlp") and not follows_fused_decode(False, True, "fused-mlp")
    with pytest.raises(ValueError, match="--kernel-options fused-mlp=on needs fused-decode"):
        follows_fused_decode(True, False, "fused-mlp")


# Triton's kernels and the one-token steps' fused ones (on a CPU under the interpreter).
DECODE_KERNELS = "fused-kernels=on,triton-gemv=on,fused-decode=on"
# Three layers: the last takes the third sum buffer (the first's must be zero for the next step).
SPEC = ModelSpec(num_layers=3, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                 vocab_size=1024, max_position_embeddings=512, rope_theta=10_000.0, dtype="float32", init_std=0.12,
                 seed=8)


@pytest.mark.usefixtures("few_sms")
def test_engine_greedy_tokens_with_the_fused_mlp(tmp_path: Path, device: torch.device) -> None:
    """Batch-1 generation with fused-mlp on the triton backend: the greedy tokens of the same
    engine without it, over two requests one after the other (the sums zero again between steps);
    and two requests at once before and after (their steps of two rows run torch's matmul, over
    down's weight as loaded, then as stored transposed by the first one-token step)."""
    if device.type == "cuda":
        pytest.skip("the GPU's bf16 case is test_bf16_engine_greedy_tokens_fused_mlp")
    checkpoint = make_checkpoint(tmp_path / "model", SPEC)
    common = dict(device=device.type, max_total_tokens=1024, max_running_requests=2, attention_backend="triton",
                  disable_cuda_graph=True)
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [[7, 300, 41, 999, 12], [5, 77, 1000]]
    reference_engine = Engine(str(checkpoint), kernel_options=DECODE_KERNELS + ",fused-mlp=off", **common)
    assert not reference_engine.built.plan.fused_mlp
    expected = [reference_engine.generate(input_ids=[p], sampling_params=params)[0].token_ids for p in prompts]
    fused = Engine(str(checkpoint), kernel_options=DECODE_KERNELS + ",fused-mlp=on", **common)
    model = fused.scheduler.runner.model
    assert fused.built.plan.fused_mlp and model.fused_decode is not None and model.fused_decode.kernels.fused_mlp is not None
    # What the runner does before capturing graphs (they record the weights' final addresses).
    assert not model.fused_decode.down_transposed
    model.prepare_decode_weights()
    addresses = [layer.mlp.down_proj.weight.data_ptr() for layer in model.layers]
    assert model.fused_decode.down_transposed and all(layer.mlp.down_proj.weight.t().is_contiguous() for layer in model.layers)

    def together() -> list[list[int]]:
        # Both finish together: every decode step has two rows (torch's matmul, not the fused MLP).
        return [r.token_ids for r in fused.generate(input_ids=prompts, sampling_params=params)]
    assert together() == expected
    got = [fused.generate(input_ids=[p], sampling_params=params)[0].token_ids for p in prompts]
    assert got == expected and all(len(tokens) == params.max_new_tokens for tokens in got)
    assert together() == expected
    # Down's weights are stored transposed once (the steps moved none), the same values, and no
    # more memory than without.
    assert [layer.mlp.down_proj.weight.data_ptr() for layer in model.layers] == addresses
    for layer, ref_layer in zip(model.layers, reference_engine.scheduler.runner.model.layers):
        weight = layer.mlp.down_proj.weight
        assert weight.t().is_contiguous() and not weight.is_contiguous()
        assert torch.equal(weight, ref_layer.mlp.down_proj.weight)
    assert model_bytes(model) == model_bytes(reference_engine.scheduler.runner.model) + model.fused_decode.mlp_sums.numel() * 4
    # After a whole step the last layer's sum is the lm_head's input; the other two are zero.
    assert torch.count_nonzero(model.fused_decode.mlp_sums[:2]) == 0 and torch.count_nonzero(model.fused_decode.mlp_sums[2]) > 0


@pytest.mark.usefixtures("few_sms")
def test_the_launch_flag_parses_and_reaches_the_kernel(tmp_path: Path, device: torch.device) -> None:
    """fused-mlp-config: name=value pairs changing the tuned launch, a clear error otherwise;
    through the engine, tiles of one activation loaded early give the reference's
    greedy tokens."""
    # The option (parsed without triton) names exactly the kernel config's fields.
    assert FusedMlpKnobs._fields == FusedMlpConfig._fields
    assert FusedMlpKnobs.parse("").changes() == {}
    assert FusedMlpKnobs.parse(" block_n=2, early_tile=1 ").changes() == {"block_n": 2, "early_tile": True}
    assert FusedMlpKnobs.parse("early_tile=0,programs=256").changes() == {"early_tile": False, "programs": 256}
    for bad in ("block_n", "block_n=2,block_n=4", "warps=4", "num_stages=-1"):
        with pytest.raises(ValueError, match="fused-mlp-config takes name=value pairs"):
            FusedMlpKnobs.parse(bad)
    with pytest.raises(ValueError, match="--kernel-options fused-mlp-config takes"):
        parse_server_args(["--kernel-options", "fused-mlp-config=stages=2"])
    if device.type == "cuda":
        pytest.skip("the engine part is an interpreter-sized case")
    checkpoint = make_checkpoint(tmp_path / "model", SPEC)
    common = dict(device=device.type, max_total_tokens=512, max_running_requests=1, attention_backend="triton",
                  disable_cuda_graph=True)
    with pytest.raises(ValueError, match="fused-mlp-config: block_n a power of two"):
        Engine(str(checkpoint), kernel_options=DECODE_KERNELS + ",fused-mlp-config=block_n=3", **common)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = [[7, 300, 41, 999, 12]]
    want = Engine(str(checkpoint), kernel_options=DECODE_KERNELS + ",fused-mlp=off", **common).generate(
        input_ids=prompt, sampling_params=params)
    spec = "block_n=2+num_warps=4+early_tile=1"
    engine = Engine(str(checkpoint), kernel_options=f"{DECODE_KERNELS},fused-mlp-config={spec}", **common)
    assert engine.built.plan.fused_mlp and engine.built.plan.fused_mlp_knobs == FusedMlpKnobs.parse(spec)
    kernel = engine.scheduler.runner.model.fused_decode.kernels.fused_mlp
    assert kernel.keywords["config"] == FusedMlpConfig(block_n=2, num_warps=4, early_tile=True)
    assert engine.generate(input_ids=prompt, sampling_params=params)[0].token_ids == want[0].token_ids


@pytest.mark.usefixtures("few_sms")
def test_one_layer_keeps_the_two_kernel_mlp(tmp_path: Path, device: torch.device) -> None:
    """A model of one layer would zero its own sum: --fused-mlp stays unused there, and the
    engine generates with the two-kernel path."""
    if device.type == "cuda":
        pytest.skip("an interpreter-sized case")
    checkpoint = make_checkpoint(tmp_path / "model", dataclasses.replace(SPEC, num_layers=1))
    engine = Engine(str(checkpoint), device=device.type, max_total_tokens=256, max_running_requests=1,
                    kernel_options=DECODE_KERNELS + ",fused-mlp=on", attention_backend="triton",
                    disable_cuda_graph=True)
    kernels = engine.scheduler.runner.model.fused_decode.kernels
    assert kernels is not None and kernels.fused_mlp is None
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(engine.generate(input_ids=[[1, 2, 3]], sampling_params=params)[0].token_ids) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("pdl_mode", ["", "off"], ids=["default", "no-pdl"])
def test_bf16_engine_greedy_tokens_fused_mlp(tmp_path: Path, device: torch.device, pdl_mode: str) -> None:
    """fused-mlp compiled for the GPU, inside the batch-1 CUDA graph, against the same engine
    without it: greedy tokens equal wherever the reference's top-2 gap is clear; with the gemvs'
    PDL on (by default the kernel lets qkv launch at its programs' start: down=wait) and off; the
    default modes follow the MLP path (the reference's down gemv lets the next kernel in late)."""
    from test_fused_model import DECODE_KERNELS as DECODE, WIDE_BATCH1_ENGINE, assert_batch1_greedy_tokens_equal, wide_bf16_spec

    checkpoint = make_checkpoint(tmp_path / "model", wide_bf16_spec(num_layers=3, seed=23))
    reference_engine = Engine(str(checkpoint), kernel_options=dataclasses.replace(DECODE, fused_mlp=False),
                              **WIDE_BATCH1_ENGINE)
    fused = Engine(str(checkpoint), kernel_options=dataclasses.replace(DECODE, fused_mlp=True,
                                                                       gemv_pdl_mode=pdl_mode or "auto"),
                   **WIDE_BATCH1_ENGINE)
    assert fused.built.plan.fused_mlp and fused.built.plan.gemv_pdl_mode == (pdl_mode or DEFAULT_PDL_MODE)
    assert reference_engine.built.plan.gemv_pdl_mode == PLAIN_MLP_PDL_MODE
    prompts = [[(31 * i + 7 * n) % 1024 for i in range(n)] for n in (3, 9, 23, 47, 90, 150)]
    assert_batch1_greedy_tokens_equal(reference_engine, fused, prompts)


def assert_the_chain_matches_the_plain_one(chain: Callable[[bool], None], results: torch.Tensor, tol: float, repeats: int = 1) -> None:
    """``chain(pdl)`` writes ``results[int(pdl)]`` (resetting it first): the programmatic chain's
    result against the plain one's, run eagerly and then replayed from a CUDA graph (``repeats``
    times each), finite and within ``tol``."""
    for _ in range(repeats):
        chain(False)
        chain(True)
    torch.cuda.synchronize()
    assert torch.isfinite(results).all() and rel_err(results[1], results[0].double()) <= tol
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(True)
    results.fill_(float("nan"))
    for _ in range(repeats):
        graph.replay()
    chain(False)
    torch.cuda.synchronize()
    assert torch.isfinite(results).all() and rel_err(results[1], results[0].double()) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("o_mode", ["preload", "late"])
def test_a_dependent_launch_waits_for_the_gemv_before_it(device: torch.device, o_mode: str) -> None:
    """``dependent``: launched as the programmatic dependent of an o-shaped gemv that lets it in
    at its start ("preload") or after its K loop ("late"), the kernel reads x only once the gemv
    has written it all (x poisoned with NaN before each chain): the same sum as a plain launch, up
    to the atomics' order, eagerly and replayed from a CUDA graph."""
    from app.kernels.triton_gemv import gemv

    k, intermediate = 2048, 8192
    _, residual, norm_weight, gate_up, down = make_inputs(k, intermediate, torch.bfloat16, device, seed=17)
    down_t = down_transposed(down)
    attn = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    w_o = torch.randn(k, k, device=device, dtype=torch.bfloat16) * k ** -0.5
    o_out = torch.empty(1, k, device=device, dtype=torch.bfloat16)
    sums = torch.zeros(2, 1, k, device=device, dtype=torch.float32)

    def chain(dependent: bool) -> None:
        o_out.fill_(float("nan"))
        sums[int(dependent)].zero_()
        gemv(attn, w_o, out=o_out, pdl=o_mode)
        fused_mlp(o_out, residual, norm_weight, 1e-5, gate_up, down_t, sums[int(dependent)], dependent=dependent)

    assert_the_chain_matches_the_plain_one(chain, sums, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("at_start", [False, True], ids=["after-loop", "at-start"])
def test_the_gemv_after_it_waits_for_the_whole_sum(device: torch.device, at_start: bool) -> None:
    """The kernel lets the next layer's qkv gemv (norm prologue over its float32 sum) launch as a
    programmatic dependent that waits, after its tile loop or at its programs' start:
    the gemv reads the sum only once every program's atomics have landed, so its output equals
    the same chain launched plainly, eagerly and replayed from a CUDA graph."""
    from app.kernels.triton_gemv import gemv_add_rms_norm

    k, intermediate, n = 2048, 8192, 3072
    x, residual, norm_weight, gate_up, down = make_inputs(k, intermediate, torch.bfloat16, device, seed=29)
    down_t = down_transposed(down)
    w_qkv = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
    sums = torch.zeros(2, 1, k, device=device, dtype=torch.float32)
    outs = torch.empty(2, 1, n, device=device, dtype=torch.bfloat16)

    def chain(pdl: bool) -> None:
        sums[int(pdl)].zero_()
        outs[int(pdl)].fill_(float("nan"))
        _, h = fused_mlp(x, residual, norm_weight, 1e-5, gate_up, down_t, sums[int(pdl)], trigger=pdl,
                         trigger_at_start=at_start)
        gemv_add_rms_norm(sums[int(pdl)], h, norm_weight, 1e-5, w_qkv, out=outs[int(pdl)], pdl="wait" if pdl else False)

    assert_the_chain_matches_the_plain_one(chain, outs, 1e-2, repeats=3)


@pytest.mark.gpu
def test_the_probe_records_each_program(device: torch.device) -> None:
    """``probe`` (lab/tools/bench_fused_mlp.py --probe): every program records a real SM and its start,
    the end of its wait and its end in that order (ns of one global clock); the sum is the plain
    launch's; a probe too small for the grid is a ValueError naming the programs."""
    from app.kernels.triton_gemv import device_sms

    k, intermediate = 2048, 8192
    x, residual, norm_weight, gate_up, down = make_inputs(k, intermediate, torch.bfloat16, device, seed=19)
    down_t = down_transposed(down)
    sums = torch.zeros(2, 1, k, device=device, dtype=torch.float32)
    sms = device_sms(device)
    probe = torch.zeros(sms, 4, device=device, dtype=torch.int64)
    fused_mlp(x, residual, norm_weight, 1e-5, gate_up, down_t, sums[0])
    fused_mlp(x, residual, norm_weight, 1e-5, gate_up, down_t, sums[1], probe=probe)
    torch.cuda.synchronize()
    assert rel_err(sums[1], sums[0].double()) <= 1e-5
    ran = probe[probe[:, 1] > 0].cpu()
    programs = even_programs(intermediate // 2, sms)
    assert len(ran) == programs and int(probe[programs:].abs().sum()) == 0
    assert ((ran[:, 0] >= 0) & (ran[:, 0] < sms)).all()
    assert ((ran[:, 1] <= ran[:, 2]) & (ran[:, 2] < ran[:, 3])).all()
    assert int((ran[:, 3] - ran[:, 1]).max()) < 10_000_000  # a kernel of ~30 us: well under 10 ms
    with pytest.raises(ValueError, match=f"fused_mlp: probe must be a contiguous int64 buffer of at least 4 x {programs}"):
        fused_mlp(x, residual, norm_weight, 1e-5, gate_up, down_t, sums[1], probe=probe[:2])


def test_even_programs_split_the_tiles_evenly() -> None:
    """The largest count from 3/4 of the cap up that divides the tiles, else the cap (or the tiles)."""
    assert even_programs(4096, 264) == 256  # the 1B on the H200: 16 tiles each
    assert even_programs(7168, 264) == 256  # the 8B: 28 each
    assert even_programs(64, 264) == 64 and even_programs(1000, 8) == 8
    assert even_programs(4099, 264) == 264  # a prime: no even split near the cap
