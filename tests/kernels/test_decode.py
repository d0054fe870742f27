"""Split-KV paged decode attention against a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_checks import DTYPES, assert_close, paged_kv, poisoned, reference_attention

from app.kernels.triton_decode import decode_attention, num_kv_splits_for, step_slots_split_cap

# (q heads per kv head, head_dim): GQA ratios 1/2/4/8, both head dims.
GROUPS = [(1, 64), (2, 128), (4, 64), (8, 128)]


def run_decode(seq_lens: list[int], group: int, head_dim: int, dtype: torch.dtype, device: torch.device, *,
               num_kv_heads: int = 2, max_kv_splits: int = 4, min_split_len: int = 32, block_n: int = 32,
               seed: int = 0, num_warps: int = 4, early_v: bool = False, num_stages: int | None = None,
               prefetch_slots: bool = False, reduce_in_stage1: bool = False,
               split_counters: torch.Tensor | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    kv = paged_kv(seq_lens, num_kv_heads, head_dim, dtype, device, gen)
    batch, num_heads = len(seq_lens), num_kv_heads * group
    q = torch.randn((batch, num_heads, head_dim), generator=gen).to(dtype).to(device)
    seq_lens_t = torch.tensor(seq_lens, device=device)
    splits = num_kv_splits_for(seq_lens_t, max_kv_splits, min_split_len)
    out = poisoned(q.shape, dtype, device)
    result = decode_attention(q, kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, seq_lens_t, splits,
                              max_kv_splits=max_kv_splits, out=out, block_n=block_n, num_warps=num_warps,
                              early_v=early_v, num_stages=num_stages, prefetch_slots=prefetch_slots,
                              reduce_in_stage1=reduce_in_stage1,
                              split_counters=split_counters)
    assert result is out
    ref = reference_attention(q, kv, [n - 1 for n in seq_lens], [1] * batch, 1 / math.sqrt(head_dim))
    assert_close(out, ref, dtype)


REDUCE = [False, True]  # the splits merged by stage 2, or by the last stage-1 program (one kernel)
REDUCE_IDS = ["stage2", "in-stage1"]


@pytest.mark.parametrize("reduce_in_stage1", REDUCE, ids=REDUCE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("group", "head_dim"), GROUPS)
def test_ragged_batch(group: int, head_dim: int, dtype: torch.dtype, reduce_in_stage1: bool,
                      device: torch.device) -> None:
    # 1 token, under one block, several splits with a short last one, all four splits.
    run_decode([1, 23, 70, 129], group, head_dim, dtype, device, reduce_in_stage1=reduce_in_stage1)


@pytest.mark.parametrize("reduce_in_stage1", REDUCE, ids=REDUCE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_context(dtype: torch.dtype, reduce_in_stage1: bool, device: torch.device) -> None:
    """A long context cut into the maximum number of splits, next to a short one."""
    run_decode([1500, 9], 4, 128, dtype, device, max_kv_splits=4, min_split_len=64, block_n=64,
               reduce_in_stage1=reduce_in_stage1)


def test_one_split_writes_the_output_in_stage1(device: torch.device) -> None:
    """max_kv_splits 1 (large batches): one kernel, against the reference; so does asking for the
    in-stage-1 merge, which one split does not need (its counters are not touched)."""
    run_decode([1, 23, 70, 129], 4, 64, torch.bfloat16, device, max_kv_splits=1)
    counters = torch.full((4, 2), 7, dtype=torch.int32, device=device)
    run_decode([1, 23, 70, 129], 4, 64, torch.float32, device, max_kv_splits=1, reduce_in_stage1=True,
               split_counters=counters)
    assert counters.eq(7).all()


def test_in_stage1_merge_leaves_its_counters_zero_for_the_next_call(device: torch.device) -> None:
    """One counter buffer, larger than the batch, serves call after call (as a CUDA graph replays it)."""
    counters = torch.zeros((6, 2), dtype=torch.int32, device=device)
    for seed, lens in enumerate(([3, 90, 200], [65, 1, 128, 31])):
        run_decode(lens, 2, 64, torch.float32, device, reduce_in_stage1=True, split_counters=counters, seed=seed)
        assert not counters.any()
    with pytest.raises(ValueError, match="split_counters must be int32"):
        run_decode([3, 90, 200], 2, 64, torch.float32, device, reduce_in_stage1=True,
                   split_counters=torch.zeros((2, 2), dtype=torch.int32, device=device))


@pytest.mark.parametrize(("block_n", "num_warps", "early_v", "num_stages", "prefetch_slots"),
                         [(16, 2, True, None, False), (64, 8, False, 1, False), (32, 4, True, 2, False),
                          (64, 4, False, 4, False), (16, 4, False, None, True), (32, 2, True, 2, True)])
def test_launch_knobs(block_n: int, num_warps: int, early_v: bool, num_stages: int | None, prefetch_slots: bool,
                      device: torch.device) -> None:
    """The knobs lab/tools/bench_decode_attention.py sweeps change the launch, not the result (with
    prefetched slots: splits of one block and of several, the last one partial)."""
    run_decode([1, 40, 200], 4, 64, torch.bfloat16, device, block_n=block_n, num_warps=num_warps, early_v=early_v,
               num_stages=num_stages, prefetch_slots=prefetch_slots)


@pytest.mark.parametrize("max_kv_splits", [1, 2])
def test_mid_batch_launch(max_kv_splits: int, device: torch.device) -> None:
    """The backend's launch at mid batches (decode_block_n_for): 128 keys a step at 4 warps, one
    or two splits a sequence, contexts shorter and longer than a block."""
    run_decode([1, 40, 129, 300], 4, 64, torch.bfloat16, device, max_kv_splits=max_kv_splits, min_split_len=64,
               block_n=128, num_warps=4)


def test_split_counts_agree(device: torch.device) -> None:
    """The result does not depend on how the context is split (1 split = no split at all)."""
    seq_lens = [5, 64, 333]
    outs = []
    for max_splits, min_len in ((1, 1), (3, 1), (8, 16)):
        gen = torch.Generator().manual_seed(3)
        kv = paged_kv(seq_lens, 2, 64, torch.float32, device, gen)
        q = torch.randn((3, 4, 64), generator=gen).to(device)
        lens = torch.tensor(seq_lens, device=device)
        splits = num_kv_splits_for(lens, max_splits, min_len)
        outs.append(decode_attention(q, kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, lens, splits,
                                     max_kv_splits=max_splits, block_n=16))
    assert_close(outs[1], outs[0], torch.float32)
    assert_close(outs[2], outs[0], torch.float32)


@pytest.mark.parametrize("reduce_in_stage1", REDUCE, ids=REDUCE_IDS)
def test_split_counts_from_the_lengths_in_the_kernels(reduce_in_stage1: bool, device: torch.device) -> None:
    """num_kv_splits None: the kernels apply num_kv_splits_for's rule to seq_lens themselves; the
    output is bit for bit that of the counts passed explicitly (padded rows of length 0 too)."""
    gen = torch.Generator().manual_seed(6)
    seq_lens = [1, 31, 32, 33, 200, 0, 95]
    kv = paged_kv([max(n, 1) for n in seq_lens], 2, 64, torch.float32, device, gen)
    q = torch.randn((len(seq_lens), 4, 64), generator=gen).to(device)
    lens = torch.tensor(seq_lens, device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, lens)
    for cap, min_len in ((4, 32), (3, 16), (8, 64)):
        given = decode_attention(*args, num_kv_splits_for(lens, cap, min_len), max_kv_splits=cap, block_n=16,
                                 reduce_in_stage1=reduce_in_stage1)
        derived = decode_attention(*args, None, max_kv_splits=cap, min_split_len=min_len, block_n=16,
                                   reduce_in_stage1=reduce_in_stage1)
        assert torch.equal(given, derived), (cap, min_len)
    with pytest.raises(ValueError, match="min_split_len must be >= 1"):
        decode_attention(*args, None, min_split_len=0)


def test_num_kv_splits_for() -> None:
    lens = torch.tensor([0, 1, 256, 257, 10_000])
    assert num_kv_splits_for(lens, 16, 256).tolist() == [1, 1, 1, 2, 16]
    assert num_kv_splits_for(lens, 4, 1).dtype == torch.int32
    with pytest.raises(ValueError, match="max_kv_splits"):
        num_kv_splits_for(lens, 0, 256)


def test_rejects_bad_inputs(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    kv = paged_kv([4, 5], 2, 64, torch.float32, device, gen)
    lens = torch.tensor([4, 5], device=device)
    splits = num_kv_splits_for(lens, 2, 2)
    args = (kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, lens, splits)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode_attention(torch.zeros((2, 3, 64), device=device), *args)
    with pytest.raises(ValueError, match="same head_dim"):
        decode_attention(torch.zeros((2, 4, 32), device=device), *args)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(torch.zeros((2, 4, 64), device=device), *args[:4], lens[:1], splits)
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        decode_attention(torch.zeros((2, 4, 64), dtype=torch.int32, device=device), *args)
    with pytest.raises(ValueError, match="out must be"):
        decode_attention(torch.zeros((2, 4, 64), device=device), *args, out=torch.zeros((2, 4, 63), device=device))
    with pytest.raises(ValueError, match="num_warps a power of two <= 16, got 16, 64, 3"):
        decode_attention(torch.zeros((2, 4, 64), device=device), *args, num_warps=3)
    with pytest.raises(ValueError, match="num_stages must be in 1..8"):
        decode_attention(torch.zeros((2, 4, 64), device=device), *args, num_stages=0)


@pytest.mark.gpu
@pytest.mark.parametrize("reduce_in_stage1", REDUCE, ids=REDUCE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("group", "head_dim"), GROUPS)
def test_large_ragged_batch_gpu(group: int, head_dim: int, dtype: torch.dtype, reduce_in_stage1: bool,
                                device: torch.device) -> None:
    """Compiled, with 64 x 8 x 16 programs racing for their tickets in the in-stage-1 merge (a
    partial read before another program's store lands would show as a wrong head)."""
    gen = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(1, 4096, (61,), generator=gen).tolist() + [32_768, 1, 4097]
    for _ in range(3 if reduce_in_stage1 else 1):
        run_decode(seq_lens, group, head_dim, dtype, device, num_kv_heads=8, max_kv_splits=16, min_split_len=256,
                   block_n=64, reduce_in_stage1=reduce_in_stage1)


@pytest.mark.parametrize(("max_splits", "reduce_in_stage1"), [(2, False), (2, True), (1, False)],
                         ids=["stage2", "in-stage1", "one-split"])
def test_empty_context_gives_zeros(max_splits: int, reduce_in_stage1: bool, device: torch.device) -> None:
    """A padded row with no context (seq_len 0) gets zeros, never NaN, and does not disturb others."""
    gen = torch.Generator().manual_seed(4)
    kv = paged_kv([7, 1], 1, 64, torch.float32, device, gen)
    q = torch.randn((2, 2, 64), generator=gen).to(device)
    lens = torch.tensor([7, 0], device=device)
    out = decode_attention(q, kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, lens,
                           num_kv_splits_for(lens, max_splits, 4), max_kv_splits=max_splits,
                           out=poisoned(q.shape, q.dtype, device), reduce_in_stage1=reduce_in_stage1)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = reference_attention(q[:1], kv._replace(req_pool_indices=kv.req_pool_indices[:1]), [6], [1], 1 / 8)
    assert_close(out[:1], ref, torch.float32)


@pytest.mark.parametrize("reduce_in_stage1", REDUCE, ids=REDUCE_IDS)
@pytest.mark.parametrize(("max_kv_splits", "block_n", "prefetch_slots"), [(4, 32, False), (4, 32, True), (1, 16, True),
                                                                           (2, 16, False)])
def test_step_slots_recorded_by_the_first_layer_serve_the_others(max_kv_splits: int, block_n: int,
                                                                  prefetch_slots: bool, reduce_in_stage1: bool,
                                                                  device: torch.device) -> None:
    """The first layer's call records each split's slots; a later layer's call (other K/V, the
    same table and lengths) reads them from there, not from the table: with the table's rows
    wiped after the recording it still attends the recorded slots. Stale entries (from a longer
    earlier step, or past the pool) are never read as K/V."""
    seq_lens, group, head_dim = [1, 23, 70, 129], 2, 64
    gen = torch.Generator().manual_seed(5)
    first, later = (paged_kv(seq_lens, 2, head_dim, torch.float32, device, torch.Generator().manual_seed(9))
                    for _ in range(2))
    later = later._replace(k_cache=later.k_cache * 0.5 + 0.25)  # another layer: other K/V, the same slots
    batch = len(seq_lens)
    q = torch.randn((batch, 2 * group, head_dim), generator=gen).to(device)
    lens = torch.tensor(seq_lens, device=device)
    columns = max_kv_splits * step_slots_split_cap(first.req_to_token.shape[1], max_kv_splits, 32, block_n)
    step_slots = torch.full((batch + 1, columns), 2**30, dtype=torch.int32, device=device)  # stale: far past the pool
    knobs = dict(max_kv_splits=max_kv_splits, min_split_len=32, block_n=block_n, prefetch_slots=prefetch_slots,
                 reduce_in_stage1=reduce_in_stage1, step_slots=step_slots)
    scale = 1 / math.sqrt(head_dim)
    for layer, record in ((first, True), (later, False)):
        out = decode_attention(q, layer.k_cache, layer.v_cache, layer.req_to_token, layer.req_pool_indices, lens,
                               None, record_step_slots=record, **knobs)
        assert_close(out, reference_attention(q, layer, [n - 1 for n in seq_lens], [1] * batch, scale), torch.float32)
    wiped = later._replace(req_to_token=torch.zeros_like(later.req_to_token))
    out = decode_attention(q, wiped.k_cache, wiped.v_cache, wiped.req_to_token, wiped.req_pool_indices, lens, None,
                           **knobs)
    assert_close(out, reference_attention(q, later, [n - 1 for n in seq_lens], [1] * batch, scale), torch.float32)
    with pytest.raises(ValueError, match="step_slots must be int32"):
        decode_attention(q, first.k_cache, first.v_cache, first.req_to_token, first.req_pool_indices, lens, None,
                         **{**knobs, "step_slots": step_slots[:, :columns - 1]})
    with pytest.raises(ValueError, match="split counts from the lengths"):
        decode_attention(q, first.k_cache, first.v_cache, first.req_to_token, first.req_pool_indices, lens,
                         num_kv_splits_for(lens, max_kv_splits, 32), **knobs)
    with pytest.raises(ValueError, match="needs a step_slots buffer"):
        decode_attention(q, first.k_cache, first.v_cache, first.req_to_token, first.req_pool_indices, lens, None,
                         **{**knobs, "step_slots": None}, record_step_slots=True)


@pytest.mark.gpu
@pytest.mark.parametrize("trigger_dependents", [False, True], ids=["alone", "o-triggered"])
def test_stage2_as_stage1_dependent_gpu(trigger_dependents: bool, device: torch.device) -> None:
    """Stage 2 launched as stage 1's programmatic dependent computes the same bits as launched
    plainly, eagerly and replayed in a CUDA graph with new queries (it waits for stage 1's
    partials before loading them)."""
    gen = torch.Generator().manual_seed(6)
    seq_lens = [1, 640, 1152, 77]
    kv = paged_kv(seq_lens, 8, 64, torch.bfloat16, device, gen)
    q = torch.randn((len(seq_lens), 32, 64), generator=gen).to(torch.bfloat16).to(device)
    lens = torch.tensor(seq_lens, device=device)
    knobs = dict(max_kv_splits=16, min_split_len=64, block_n=64, prefetch_slots=True,
                 trigger_dependents=trigger_dependents)
    args = (kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, lens, None)
    plain = decode_attention(q, *args, **knobs)
    out = torch.empty_like(plain)
    assert torch.equal(decode_attention(q, *args, out=out, stage2_pdl=True, **knobs), plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, *args, out=out, stage2_pdl=True, **knobs)
    q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, decode_attention(q, *args, **knobs))


def test_stage2_as_a_dependent_needs_cuda() -> None:
    q = torch.zeros((1, 2, 64))
    kv = paged_kv([3], 1, 64, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="stage2_pdl .programmatic dependent launch. needs a CUDA device"):
        decode_attention(q, kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, torch.tensor([3]), None,
                         stage2_pdl=True)
