"""Paged extend (prefill over a cached prefix) attention against a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_checks import DTYPES, assert_close, paged_kv, poisoned, reference_attention

from app.kernels.triton_extend import extend_attention, extend_blocks

GROUPS = [(1, 64), (2, 128), (4, 64), (8, 128)]


def run_extend(prefix_lens: list[int], extend_lens: list[int], group: int, head_dim: int, dtype: torch.dtype,
               device: torch.device, *, num_kv_heads: int = 2, block_m: int = 16, block_n: int = 16,
               seed: int = 0, num_warps: int = 4, num_stages: int | None = None, pack_gqa: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    kv = paged_kv([p + e for p, e in zip(prefix_lens, extend_lens)], num_kv_heads, head_dim, dtype, device, gen)
    num_heads = num_kv_heads * group
    q = torch.randn((sum(extend_lens), num_heads, head_dim), generator=gen).to(dtype).to(device)
    extend_t = torch.tensor(extend_lens, device=device)
    blocks = extend_blocks(extend_t, extend_lens, block_m)
    out = poisoned(q.shape, dtype, device)
    result = extend_attention(q, kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices,
                              torch.tensor(prefix_lens, device=device), extend_t, blocks, out=out, block_n=block_n,
                              num_warps=num_warps, num_stages=num_stages, pack_gqa=pack_gqa)
    assert result is out
    assert_close(out, reference_attention(q, kv, prefix_lens, extend_lens, 1 / math.sqrt(head_dim)), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("group", "head_dim"), GROUPS)
def test_ragged_batch_with_prefixes(group: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    # No prefix; a prefix that is not block-aligned with several query blocks; a 1-token extend
    # (decode-like); an extend ending exactly on a block boundary.
    run_extend([0, 21, 40, 3], [19, 35, 1, 16], group, head_dim, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_prefix(dtype: torch.dtype, device: torch.device) -> None:
    """A chunk of a long chunked prefill on top of 700 cached tokens, next to a fresh prompt."""
    run_extend([700, 0], [40, 9], 4, 128, dtype, device, block_m=32, block_n=64)


def test_extend_blocks_layout() -> None:
    extend = [5, 16, 17, 1]
    blocks = extend_blocks(torch.tensor(extend), extend, 16)
    assert blocks.num_blocks == 5 and blocks.block_m == 16
    assert blocks.q_start.tolist() == [0, 5, 21, 38]
    assert blocks.block_seq.tolist() == [0, 1, 2, 2, 3]
    assert blocks.block_start.tolist() == [0, 0, 0, 16, 0]
    with pytest.raises(ValueError, match="power of two"):
        extend_blocks(torch.tensor(extend), extend, 24)


def test_rejects_bad_inputs(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    kv = paged_kv([4, 5], 2, 64, torch.float32, device, gen)
    extend = torch.tensor([2, 3], device=device)
    blocks = extend_blocks(extend, [2, 3], 16)
    prefix = torch.tensor([2, 2], device=device)
    args = (kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        extend_attention(torch.zeros((5, 3, 64), device=device), *args, prefix, extend, blocks)
    with pytest.raises(ValueError, match="prefix_lens"):
        extend_attention(torch.zeros((5, 4, 64), device=device), *args, prefix[:1], extend, blocks)
    with pytest.raises(ValueError, match="block_n"):
        extend_attention(torch.zeros((5, 4, 64), device=device), *args, prefix, extend, blocks, block_n=8)
    for knobs in ({"num_warps": 3}, {"num_stages": 0}):
        with pytest.raises(ValueError, match="num_warps must be a power of two <= 16 and num_stages in 1..8"):
            extend_attention(torch.zeros((5, 4, 64), device=device), *args, prefix, extend, blocks, **knobs)
    with pytest.raises(ValueError, match="caches"):
        extend_attention(torch.zeros((5, 4, 64), device=device), kv.k_cache, kv.v_cache.half(), *args[2:],
                         prefix, extend, blocks)


@pytest.mark.parametrize(("block_m", "block_n", "num_warps", "num_stages"), [(32, 32, 2, 1), (64, 128, 8, 4)])
def test_launch_knobs(block_m: int, block_n: int, num_warps: int, num_stages: int, device: torch.device) -> None:
    """Other tilings and launches (lab/tools/bench_extend_attention.py sweeps them) compute the same."""
    run_extend([0, 37], [70, 20], 4, 64, torch.bfloat16, device, block_m=block_m, block_n=block_n,
               num_warps=num_warps, num_stages=num_stages)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("group", "block_m"), [(4, 16), (2, 32), (1, 16)])
def test_pack_gqa(group: int, block_m: int, dtype: torch.dtype, device: torch.device) -> None:
    """The q heads of a kv head in one program (a [group x block_m] row tile sharing the K/V
    loads): the same attention, ragged blocks, prefixes and a one-token extend included."""
    run_extend([0, 21, 40, 3], [19, 35, 1, 16], group, 64, dtype, device, block_m=block_m, pack_gqa=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("group", "head_dim"), GROUPS)
def test_large_ragged_batch_gpu(group: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 3000, (13,), generator=gen).tolist() + [0, 16_000, 1]
    extend = torch.randint(1, 700, (13,), generator=gen).tolist() + [4096, 1000, 1]
    run_extend(prefix, extend, group, head_dim, dtype, device, num_kv_heads=8, block_m=64, block_n=64)
    run_extend(prefix, extend, group, head_dim, dtype, device, num_kv_heads=8, block_m=16, block_n=64, pack_gqa=True)
