"""KV-cache store: new tokens' K/V land in their slots, and nothing else in the pool changes."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DTYPES

from app.kernels.triton_kv_store import store_kv


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_tokens", "num_kv_heads", "head_dim"), [(1, 1, 64), (7, 2, 128), (33, 8, 64)])
def test_store_from_fused_qkv_view(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                                   device: torch.device) -> None:
    """k/v are strided views of a fused qkv output, slots are scattered, unwritten slots stay NaN."""
    gen = torch.Generator().manual_seed(num_tokens)
    q_size, kv_size = 4 * num_kv_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn((num_tokens, q_size + 2 * kv_size), generator=gen).to(dtype).to(device)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    num_slots = 3 * num_tokens + 5
    loc = (torch.randperm(num_slots - 1, generator=gen)[:num_tokens] + 1).to(device)
    k_cache = torch.full((num_slots, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    store_kv(k_cache, v_cache, loc, k, v)
    assert torch.equal(k_cache[loc], k) and torch.equal(v_cache[loc], v)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
    untouched[loc] = False
    assert torch.isnan(k_cache[untouched]).all() and torch.isnan(v_cache[untouched]).all()


def test_casts_to_cache_dtype(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn((5, 2, 64), generator=gen).to(device) for _ in range(2))
    loc = torch.tensor([3, 1, 4, 8, 6], dtype=torch.int32, device=device)
    k_cache = torch.zeros((9, 2, 64), dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    store_kv(k_cache, v_cache, loc, k, v)
    # Within one bf16 rounding step (the interpreter truncates, a GPU rounds to nearest).
    assert torch.allclose(k_cache[loc.long()].float(), k, rtol=2**-7, atol=0)
    assert torch.allclose(v_cache[loc.long()].float(), v, rtol=2**-7, atol=0)


def test_rejects_bad_inputs(device: torch.device) -> None:
    cache = torch.zeros((9, 2, 64), device=device)
    k = torch.zeros((3, 2, 64), device=device)
    loc = torch.tensor([1, 2, 3], device=device)
    with pytest.raises(ValueError, match=r"k and v must be \[3, 2, 64\]"):
        store_kv(cache, cache.clone(), loc, k[:, :1], k)
    with pytest.raises(ValueError, match="loc must be a 1-d int32 or int64"):
        store_kv(cache, cache.clone(), loc.float(), k, k)
    with pytest.raises(ValueError, match="one dtype"):
        store_kv(cache, cache.half(), loc, k, k)
    with pytest.raises(ValueError, match="unit stride"):
        store_kv(cache, cache.clone(), loc, k.transpose(1, 2).contiguous().transpose(1, 2), k)
