"""The decode attention's split merge inside the o projection (app/kernels/triton_merge_o.py,
``--merge-o``) against a float64 reference of ``o_proj(attention)`` for one token: lengths of one
token, one split, several with a short last one and every split; GQA groups of 1 and 4; the
buffer it zeroes, its sum added to what ``out`` holds; the argument checks; on a GPU, launched
as a programmatic dependent of stage 1 (eagerly and replayed in a CUDA graph with new inputs)
equal to the plain launch; then through the engine: batch-1 greedy tokens with and without it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from kernel_checks import REL_TOL, paged_kv, reference_attention, rel_err

from app.engine import Engine
from app.engine.config import EngineConfig
from app.engine.make_checkpoint import ModelSpec, make_checkpoint
from app.engine.switches import resolve_merge_o
from app.ipc.messages import SamplingParams
from app.kernels.triton_decode import DecodePartials, decode_attention
from app.kernels.triton_merge_o import MergeOConfig, merge_o_proj
from app.server_args import parse_server_args


class Case:
    """One token's attention inputs and o's weight, with its float64 reference."""

    def __init__(self, seq_len: int, group: int, head_dim: int, hidden: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0, num_kv_heads: int = 2) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.kv = paged_kv([seq_len], num_kv_heads, head_dim, dtype, device, gen)
        self.seq_lens = torch.tensor([seq_len], device=device)
        num_heads = num_kv_heads * group
        self.q = torch.randn((1, num_heads, head_dim), generator=gen).to(dtype).to(device)
        self.weight = (torch.randn((hidden, num_heads * head_dim), generator=gen) * (num_heads * head_dim) ** -0.5
                       ).to(dtype).to(device)
        self.dtype = dtype

    def partials(self, max_kv_splits: int, min_split_len: int, trigger: bool = False,
                 late: bool = False) -> DecodePartials:
        kv = self.kv
        result = decode_attention(self.q, kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, self.seq_lens,
                                  None, max_kv_splits=max_kv_splits, min_split_len=min_split_len, block_n=32,
                                  partials=True, trigger_dependents=trigger, trigger_late=late)
        assert isinstance(result, DecodePartials)
        return result

    def reference(self) -> torch.Tensor:
        head_dim = self.q.shape[-1]
        attn = reference_attention(self.q, self.kv, [int(self.seq_lens[0]) - 1], [1], 1 / math.sqrt(head_dim))
        return attn.reshape(1, -1).double() @ self.weight.double().T


@pytest.mark.parametrize("seq_len", [1, 23, 70, 129], ids=lambda n: f"len{n}")
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (4, 32)])
def test_merge_o_matches_the_reference(seq_len: int, group: int, head_dim: int, device: torch.device) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    case = Case(seq_len, group, head_dim, hidden=48, dtype=dtype, device=device, seed=seq_len)
    partials = case.partials(max_kv_splits=4, min_split_len=32)
    # Splits past the length hold whatever was there: poison them, the merge must drop them.
    if seq_len <= 96:  # at most three splits of 32
        partials.mid_o[:, :, -1].fill_(float("nan"))
        partials.mid_lse[:, :, -1].fill_(float("nan"))
    out = torch.zeros(1, 48, dtype=torch.float32, device=device)
    zero = torch.full((1, 48), float("nan"), dtype=torch.float32, device=device)
    # 16 rows a program: three row blocks, the last one full; 32: the second one half empty.
    for block_n in (16, 32):
        out.zero_()
        got = merge_o_proj(partials, case.weight, out, zero=zero, config=MergeOConfig(block_n=block_n, num_warps=2))
        assert got is out
        err = rel_err(got, case.reference())
        assert err <= REL_TOL[dtype], f"block_n {block_n}: relative error {err:.3g}"
        assert torch.equal(zero, torch.zeros_like(zero))
        zero.fill_(float("nan"))


def test_merge_o_adds_to_the_sum_it_is_given(device: torch.device) -> None:
    """``out`` already holding a part (the atomics add to it), at 16 splits of one token each."""
    case = Case(16, 2, 64, hidden=64, dtype=torch.float32, device=device, seed=3)
    partials = case.partials(max_kv_splits=16, min_split_len=1)
    base = torch.randn(1, 64, device=device)
    out = base.clone()
    merge_o_proj(partials, case.weight, out)
    err = rel_err(out - base, case.reference())
    assert err <= REL_TOL[torch.float32], f"relative error {err:.3g}"


def test_merge_o_rejects_what_it_cannot_take(device: torch.device) -> None:
    case = Case(40, 2, 32, hidden=32, dtype=torch.float32, device=device)
    partials = case.partials(max_kv_splits=2, min_split_len=16)
    out = torch.zeros(1, 32, device=device)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        merge_o_proj(partials, case.weight[:, :-1], out)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        merge_o_proj(partials, case.weight, torch.zeros(1, 32, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="zero must be another buffer"):
        merge_o_proj(partials, case.weight, out, zero=out)
    with pytest.raises(ValueError, match="mid_o must be float32"):
        merge_o_proj(partials._replace(mid_o=partials.mid_o[0]), case.weight, out)
    with pytest.raises(ValueError, match="seq_lens must be"):
        merge_o_proj(partials._replace(seq_lens=torch.tensor([40, 40], device=device)), case.weight, out)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        merge_o_proj(partials, case.weight, out, config=MergeOConfig(block_n=24))
    if device.type != "cuda":
        with pytest.raises(ValueError, match="pdl"):
            merge_o_proj(partials, case.weight, out, pdl=True)
    with pytest.raises(ValueError, match="partials leaves the merge"):
        decode_attention(case.q, case.kv.k_cache, case.kv.v_cache, case.kv.req_to_token, case.kv.req_pool_indices,
                         case.seq_lens, None, partials=True, reduce_in_stage1=True)


@pytest.mark.gpu
@pytest.mark.parametrize("late", [False, True], ids=["trigger-at-start", "trigger-after-loop"])
@pytest.mark.parametrize("warps", [4, 1])
def test_merge_o_as_a_dependent_of_stage1_equals_the_plain_launch(device: torch.device, late: bool,
                                                                  warps: int) -> None:
    """Stage 1 triggering at its start or after its key loop, and the merge launched as its
    programmatic dependent (weights loaded before the wait): the same sums as plain launches,
    eagerly and from a CUDA graph replayed over new queries (the float32 atomics' order may
    differ: within 1e-5)."""
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    case = Case(1000, 4, 64, hidden=2048, dtype=torch.bfloat16, device=device, seed=7, num_kv_heads=8)

    def step(pdl: bool, out: torch.Tensor) -> torch.Tensor:
        out.zero_()
        return merge_o_proj(case.partials(16, 64, trigger=pdl, late=late), case.weight, out, pdl=pdl,
                            config=MergeOConfig(num_warps=warps))

    plain = step(False, torch.empty(1, 2048, device=device)).clone()
    dependent = step(True, torch.empty(1, 2048, device=device))
    torch.testing.assert_close(dependent, plain, rtol=1e-5, atol=1e-5)
    assert rel_err(plain, case.reference()) <= REL_TOL[torch.bfloat16]

    graph_out = torch.empty(1, 2048, device=device)
    step(True, graph_out)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(True, graph_out)
    for seed in (11, 12):
        case.q.copy_(torch.randn(case.q.shape, generator=torch.Generator().manual_seed(seed)).to(case.q))
        graph.replay()
        want = step(False, torch.empty(1, 2048, device=device))
        torch.testing.assert_close(graph_out, want, rtol=1e-5, atol=1e-5)


def test_the_flag_parses_and_resolves() -> None:
    """--[no-]merge-o: None by default, which is off; on, it needs --fused-decode."""
    assert EngineConfig(model_path=".").merge_o is None and parse_server_args([]).merge_o is None
    assert not resolve_merge_o(None, fused_decode=True)
    assert parse_server_args(["--merge-o"]).engine_config(".").merge_o is True
    assert parse_server_args(["--no-merge-o"]).engine_config(".").merge_o is False
    with pytest.raises(ValueError, match="--merge-o needs --fused-decode"):
        resolve_merge_o(True, fused_decode=False)


def spec(num_layers: int) -> ModelSpec:
    return ModelSpec(num_layers=num_layers, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                     head_dim=16, vocab_size=1024, max_position_embeddings=512, rope_theta=10_000.0, dtype="float32",
                     init_std=0.12, seed=8)


@pytest.mark.parametrize("fused_mlp", [False, True], ids=["gemvs", "fused-mlp"])
def test_engine_greedy_tokens_with_the_merge_in_o(tmp_path: Path, device: torch.device, fused_mlp: bool) -> None:
    """Batch-1 generation with --merge-o on the triton backend (three layers: the last takes the
    third sum buffer): the greedy tokens of the same engine without it, two requests one after
    the other (the sums zero again between steps; prompts long enough for several splits), then
    both at once (steps of two rows: the backend's own merge and o's matmul); the MLP after it
    as the gemvs or as --fused-mlp, both reading o's float32 sum."""
    if device.type == "cuda":
        pytest.skip("the GPU's bf16 case is test_bf16_engine_greedy_tokens_merge_o")
    checkpoint = make_checkpoint(tmp_path / "model", spec(3))
    common = dict(device=device.type, max_total_tokens=1024, max_running_requests=2, fused_kernels=True,
                  triton_gemv=True, fused_decode=True, attention_backend="triton", disable_cuda_graph=True,
                  fused_mlp=fused_mlp, triton_decode_min_split_len=16)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + 3) % 1000 for i in range(40)], [5, 77, 1000]]
    reference_engine = Engine(str(checkpoint), merge_o=False, **common)
    expected = [reference_engine.generate(input_ids=[p], sampling_params=params)[0].token_ids for p in prompts]
    merged = Engine(str(checkpoint), merge_o=True, **common)
    model = merged.scheduler.runner.model
    assert merged.built.merge_o and model.decode_kernels is not None and model.decode_kernels.merge_o is not None
    got = [merged.generate(input_ids=[p], sampling_params=params)[0].token_ids for p in prompts]
    assert got == expected and all(len(tokens) == params.max_new_tokens for tokens in got)
    assert [r.token_ids for r in merged.generate(input_ids=prompts, sampling_params=params)] == expected
    # After a whole step the last layer's sum is its MLP's input; the other two are zero.
    assert torch.count_nonzero(model.o_sums[:2]) == 0 and torch.count_nonzero(model.o_sums[2]) > 0


def test_one_layer_takes_neither_sum_kernel(tmp_path: Path, device: torch.device) -> None:
    """A model of one layer would zero its own sum: --merge-o and --fused-mlp stay unused there
    (the engine runs, with the plain kernels)."""
    if device.type == "cuda":
        pytest.skip("an interpreter-sized case")
    checkpoint = make_checkpoint(tmp_path / "model", spec(1))
    engine = Engine(str(checkpoint), device=device.type, max_total_tokens=256, max_running_requests=1,
                    fused_kernels=True, triton_gemv=True, fused_decode=True, attention_backend="triton",
                    disable_cuda_graph=True, merge_o=True, fused_mlp=True)
    kernels = engine.scheduler.runner.model.decode_kernels
    assert kernels is not None and kernels.merge_o is None and kernels.fused_mlp is None
    tokens = engine.generate(input_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_new_tokens=3, temperature=0.0,
                                                                                      ignore_eos=True))[0].token_ids
    assert len(tokens) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("fused_mlp", [False, True], ids=["gemvs", "fused-mlp"])
def test_bf16_engine_greedy_tokens_merge_o(tmp_path: Path, device: torch.device, fused_mlp: bool) -> None:
    """--merge-o compiled for the GPU, inside the batch-1 CUDA graph (o's kernel a programmatic
    dependent of stage 1), against the same engine without it: greedy tokens equal wherever the
    reference's top-2 gap is clear, for prompts of one to several splits."""
    from test_fused_model import WIDE_BATCH1_ENGINE, assert_batch1_greedy_tokens_equal, wide_bf16_spec

    checkpoint = make_checkpoint(tmp_path / "model", wide_bf16_spec(num_layers=3, seed=29))
    reference_engine = Engine(str(checkpoint), merge_o=False, fused_mlp=fused_mlp, **WIDE_BATCH1_ENGINE)
    merged = Engine(str(checkpoint), merge_o=True, fused_mlp=fused_mlp, **WIDE_BATCH1_ENGINE)
    assert merged.built.merge_o and merged.scheduler.runner.model.decode_kernels.merge_o is not None
    prompts = [[(31 * i + 7 * n) % 1024 for i in range(n)] for n in (3, 9, 23, 47, 90, 150)]
    assert_batch1_greedy_tokens_equal(reference_engine, merged, prompts)
