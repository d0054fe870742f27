"""Triton kernel that writes the K/V of a step's new tokens into their slots of the paged KV pool.

One program per new token copies its whole ``[num_kv_heads, head_dim]`` row of K and of V, so the
copy is one launch per layer whatever the batch, and the k/v inputs may be strided views of the
fused qkv projection (no ``.contiguous()`` copy first)::

    k [T, KVH, D] (any token/head strides, unit dim stride)      k_cache [num_slots, KVH, D]
      token t ──────────── loc[t] = slot s ──────────────────────▶ row s
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def copy_heads(src_ptr, dst_ptr, stride_sh, stride_dh, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Copy one token's ``[NUM_HEADS, HEAD_DIM]`` row (head strides given, unit dim stride), cast
    to the destination's dtype."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    x = tl.load(src_ptr + heads * stride_sh + dims, mask=mask)
    tl.store(dst_ptr + heads * stride_dh + dims, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    loc_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)  # int64: slot * row stride can pass 2**31
    copy_heads(k_ptr + t * stride_kt, k_cache_ptr + slot * stride_ct, stride_kh, stride_ch,
               NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D)
    copy_heads(v_ptr + t * stride_vt, v_cache_ptr + slot * stride_ct, stride_vh, stride_ch,
               NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D)


def check_store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   kernel: str = "store_kv") -> None:
    """The checks of :func:`store_kv` (also for kernels that write the cache the same way)."""
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"{kernel}: k_cache and v_cache must be [num_slots, num_kv_heads, head_dim] of one dtype, got "
            f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{kernel}: k_cache and v_cache must be contiguous")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"{kernel}: k_cache and v_cache must share strides")
    if loc.dim() != 1 or loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{kernel}: loc must be a 1-d int32 or int64 tensor, got {tuple(loc.shape)} {loc.dtype}")
    num_heads, head_dim = k_cache.shape[1:]
    num_tokens = loc.shape[0]
    expected = (num_tokens, num_heads, head_dim)
    if k.shape != expected or v.shape != expected:
        raise ValueError(
            f"{kernel}: k and v must be {list(expected)} for {num_tokens} slots, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{kernel}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    if len({t.device for t in (k, v, loc, k_cache, v_cache)}) != 1:
        raise ValueError(f"{kernel}: all tensors must be on one device")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"{kernel}: k and v need a unit stride along head_dim")


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k``/``v`` ``[T, num_kv_heads, head_dim]`` at slots ``loc`` ``[T]`` of one layer's caches.

    The caches are ``[num_slots, num_kv_heads, head_dim]`` (contiguous); values are cast to the
    cache dtype. Raises ValueError on mismatched shapes, devices or dtypes.
    """
    check_store_kv(k_cache, v_cache, loc, k, v)
    num_tokens, (num_heads, head_dim) = loc.shape[0], k_cache.shape[1:]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
