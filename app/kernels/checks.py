"""What the attention kernel wrappers share: argument checks (shapes, dtypes, layouts, one
device; metadata only, never values, which would need a device sync; ValueError prefixed with
the kernel's name) and the operand dtype of their dots.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_paged_attention(kernel: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          req_to_token: torch.Tensor) -> tuple[int, int, int, int]:
    """q ``[N, H, D]`` over caches ``[slots, KVH, D]`` read through a row-major request table.

    Returns ``(N, H, D, KVH)``.
    """
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{kernel}: q must be [N, H, D] and k/v caches one [slots, KVH, D] shape, got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"{kernel}: q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)} "
                         "(same head_dim, num_heads a multiple of num_kv_heads)")
    if q.dtype not in FLOAT_DTYPES or k_cache.dtype not in FLOAT_DTYPES or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{kernel}: q and the caches must be float32/bfloat16/float16 (caches alike), got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or q.stride(-1) != 1:
        raise ValueError(f"{kernel}: the caches must be contiguous and q needs a unit stride along head_dim")
    if req_to_token.dim() != 2 or req_to_token.dtype not in INDEX_DTYPES or req_to_token.stride(1) != 1:
        raise ValueError(f"{kernel}: req_to_token must be a row-major int table, got "
                         f"{tuple(req_to_token.shape)} {req_to_token.dtype}")
    return rows, num_heads, head_dim, num_kv_heads


def check_output(kernel: str, out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``out`` checked against ``like``'s shape and dtype, or a new tensor like it."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if out.shape != like.shape or out.dtype != like.dtype or out.stride(-1) != 1:
        raise ValueError(f"{kernel}: out must be {tuple(like.shape)} {like.dtype}, got {tuple(out.shape)} {out.dtype}")
    return out


def check_one_device(kernel: str, tensors: Iterable[torch.Tensor]) -> None:
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{kernel}: all tensors must be on one device")


def dot_operand_dtype(dtype: torch.dtype, kernel: object) -> tl.dtype:
    """The operand dtype of a kernel's dots: the cache dtype, except bfloat16 under triton's
    interpreter, whose dot misreads bfloat16 (seen with triton 3.9); there float32 operands give
    the same products (bf16 x bf16 is exact in float32) with float32 accumulation, as on a GPU."""
    if dtype == torch.bfloat16 and isinstance(kernel, InterpretedFunction):
        return tl.float32
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
