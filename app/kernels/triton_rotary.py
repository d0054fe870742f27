"""Triton rotary position embedding (neox layout) on q and k, in place or out of place.

Neox layout: dims ``i`` and ``i + head_dim/2`` form a pair rotated by angle ``pos * inv_freq[i]``::

    x = [x1 | x2]   (each head_dim/2)      out = [x1*cos - x2*sin | x2*cos + x1*sin]

cos/sin come either per token (``[T, head_dim/2]``, what ``RotaryEmbedding`` computes each step)
or as tables per position (``[max_pos, head_dim/2]``, built once by :func:`cos_sin_tables`) that
the kernel gathers with ``positions`` itself, so a step needs no cos/sin computation at all.
One program per token rotates all its q and k heads, in blocks of heads, with cos/sin loaded once.

:func:`apply_rotary_store_kv` (``fused-decode``) also writes the rotated k and the v of each
token to its slot of the paged KV cache, as triton_kv_store.store_kv would after it: one kernel
instead of two, and the rotated k goes to the cache straight from registers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from app.kernels.triton_kv_store import check_store_kv, copy_heads

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    t,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    cos,
    sin,
    cache_ptr,  # TO_CACHE: the token's row of a KV cache, where the rotated heads go too
    stride_ch,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TO_CACHE: tl.constexpr,
):
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    for h0 in range(0, NUM_HEADS, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < NUM_HEADS) & (dims < HALF)
        src = src_ptr + t * stride_st + heads * stride_sh + dims
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        dst = dst_ptr + t * stride_dt + heads * stride_dh + dims
        out_ty = dst_ptr.dtype.element_ty
        tl.store(dst, o1.to(out_ty), mask=mask)
        tl.store(dst + HALF, o2.to(out_ty), mask=mask)
        if TO_CACHE:
            # What the cache gets is what the rotated tensor holds: rounded to its dtype first.
            cache = cache_ptr + heads * stride_ch + dims
            cache_ty = cache_ptr.dtype.element_ty
            tl.store(cache, o1.to(out_ty).to(cache_ty), mask=mask)
            tl.store(cache + HALF, o2.to(out_ty).to(cache_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if HAS_POSITIONS:
        row = tl.load(pos_ptr + t).to(tl.int64)
    else:
        row = t
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + row * stride_cos + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_cos + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin, q_out_ptr, 0,
                  NUM_Q_HEADS, HALF, BLOCK_H, BLOCK_HALF, False)
    _rotate_heads(k_ptr, k_out_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin, k_out_ptr, 0,
                  NUM_K_HEADS, HALF, BLOCK_H, BLOCK_HALF, False)


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    loc_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_ch,
    stride_cos,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Token t: q and k rotated in place by the tables' row positions[t]; the rotated k and v
    also written to row loc[t] of the caches."""
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)  # int64: slot * row stride can pass 2**31
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + row * stride_cos + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_cos + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_ptr, t, stride_qt, stride_qh, stride_qt, stride_qh, cos, sin, q_ptr, 0,
                  NUM_Q_HEADS, HALF, BLOCK_H, BLOCK_HALF, False)
    _rotate_heads(k_ptr, k_ptr, t, stride_kt, stride_kh, stride_kt, stride_kh, cos, sin,
                  k_cache_ptr + slot * stride_ct, stride_ch, NUM_K_HEADS, HALF, BLOCK_H, BLOCK_HALF, True)
    copy_heads(v_ptr + t * stride_vt, v_cache_ptr + slot * stride_ct, stride_vh, stride_ch,
               NUM_K_HEADS, 2 * HALF, BLOCK_KV_H, BLOCK_D)


class RotaryOutput(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor


class CosSinTables(NamedTuple):
    """float32 ``[max_positions, head_dim/2]`` each: row p holds cos/sin of p * inv_freq."""

    cos: torch.Tensor
    sin: torch.Tensor


def cos_sin_tables(inv_freq: torch.Tensor, max_positions: int) -> CosSinTables:
    """Tables for ``apply_rotary(..., positions=...)``, computed once (float32, inv_freq's device)."""
    if inv_freq.dim() != 1 or max_positions < 1:
        raise ValueError(f"cos_sin_tables: need a 1-d inv_freq and max_positions >= 1, got "
                         f"{tuple(inv_freq.shape)}, {max_positions}")
    freqs = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq.float()[None, :]
    return CosSinTables(freqs.cos().contiguous(), freqs.sin().contiguous())


def _check_heads(x: torch.Tensor, name: str, num_tokens: int, head_dim: int) -> None:
    if x.dim() != 3 or x.shape[0] != num_tokens or x.shape[2] != head_dim or x.stride(-1) != 1:
        raise ValueError(f"apply_rotary: {name} must be [{num_tokens}, heads, {head_dim}] with a unit last stride, "
                         f"got {tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"apply_rotary: {name} must be float32, bfloat16 or float16, got {x.dtype}")


def _check_rotary(
    kernel: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks of :func:`apply_rotary`; returns cos and sin as ``[rows, head_dim/2]``."""
    if q.dim() != 3:
        raise ValueError(f"{kernel}: q must be [T, heads, head_dim], got {tuple(q.shape)}")
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"{kernel}: head_dim must be even, got {head_dim}")
    _check_heads(q, "q", num_tokens, head_dim)
    _check_heads(k, "k", num_tokens, head_dim)
    half = head_dim // 2
    cos = cos[:, 0] if cos.dim() == 3 and cos.shape[1] == 1 else cos
    sin = sin[:, 0] if sin.dim() == 3 and sin.shape[1] == 1 else sin
    rows = num_tokens if positions is None else None
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != half or cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError(f"{kernel}: cos and sin must both be [rows, {half}] with a unit last stride, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if rows is not None and cos.shape[0] != rows:
        raise ValueError(f"{kernel}: without positions, cos/sin need one row per token ({rows}), got {cos.shape[0]}")
    if positions is not None and (positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{kernel}: positions must be int32/int64 [{num_tokens}], got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    if cos.dtype not in FLOAT_DTYPES or sin.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{kernel}: cos and sin must be float tensors, got {cos.dtype}, {sin.dtype}")
    tensors = (q, k, cos, sin) + ((positions,) if positions is not None else ())
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{kernel}: all tensors must be on one device")
    return cos, sin


def _block_h(q: torch.Tensor, k: torch.Tensor, block_half: int) -> int:
    """Heads rotated per block: all of them, up to 2048 elements per load."""
    return max(1, min(triton.next_power_of_2(max(q.shape[1], k.shape[1])), 2048 // block_half))


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    inplace: bool = False,
) -> RotaryOutput:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hk, D]`` (strided views allowed) in the neox layout.

    Without ``positions``, ``cos``/``sin`` hold one row per token (``[T, D/2]``, or ``[T, 1, D/2]``
    as ``RotaryEmbedding`` returns them); with ``positions`` (int ``[T]``) they are per-position
    tables gathered in the kernel. ``inplace`` writes into q and k and returns them; otherwise new
    contiguous tensors come back. Raises ValueError on mismatched shapes, dtypes or devices.
    """
    cos, sin = _check_rotary("apply_rotary", q, k, cos, sin, positions)
    num_tokens, half = q.shape[0], q.shape[2] // 2
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return RotaryOutput(q_out, k_out)
    block_half = triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, cos, sin, positions if positions is not None else cos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
        NUM_Q_HEADS=q.shape[1],
        NUM_K_HEADS=k.shape[1],
        HALF=half,
        HAS_POSITIONS=positions is not None,
        BLOCK_H=_block_h(q, k, block_half),
        BLOCK_HALF=block_half,
    )
    return RotaryOutput(q_out, k_out)


def apply_rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
) -> RotaryOutput:
    """``apply_rotary(q, k, cos, sin, positions, inplace=True)`` then
    ``store_kv(k_cache, v_cache, loc, k, v)``, in one kernel (one program per token).

    q ``[T, Hq, D]``, k and v ``[T, Hk, D]`` may be strided views (of the qkv projection);
    ``cos``/``sin`` are :func:`cos_sin_tables` gathered at ``positions``; the caches are one
    layer's ``[num_slots, Hk, D]``, written at slots ``loc`` ``[T]``. Returns the rotated q and k
    (the inputs themselves). Raises ValueError as the two functions do.
    """
    kernel = "apply_rotary_store_kv"
    cos, sin = _check_rotary(kernel, q, k, cos, sin, positions)
    check_store_kv(k_cache, v_cache, loc, k, v, kernel)  # (k is in both checks' one-device sets)
    num_tokens, half = q.shape[0], q.shape[2] // 2
    if num_tokens == 0:
        return RotaryOutput(q, k)
    block_half = triton.next_power_of_2(half)
    _rotary_store_kv_kernel[(num_tokens,)](
        q, k, v, k_cache, v_cache, cos, sin, positions, loc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), cos.stride(0),
        NUM_Q_HEADS=q.shape[1],
        NUM_K_HEADS=k.shape[1],
        HALF=half,
        BLOCK_H=_block_h(q, k, block_half),
        BLOCK_HALF=block_half,
        BLOCK_KV_H=triton.next_power_of_2(k.shape[1]),
        BLOCK_D=2 * block_half,
    )
    return RotaryOutput(q, k)
