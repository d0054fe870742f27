"""Triton RMSNorm, and residual-add + RMSNorm fused into one pass over the hidden states.

A decoder layer does ``residual = x + residual; h = norm(residual)`` twice; fused, that is one
read of each input and one write of each output instead of three kernels and an extra round trip
through memory. Each program normalises one row; the sum of squares is in float32, and the sum
``x + residual`` is rounded to the residual dtype before it is normalised, so the fused kernel
gives the numbers of the unfused model (``x = x + attn(x); h = norm(x)``).

Rows may be strided (e.g. the q heads of a fused qkv projection for Qwen3's per-head q/k norm):
row ``i`` of an ``[A, B, N]`` input sits at ``(i // B) * stride_a + (i % B) * stride_b``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_BLOCK = 8192  # elements per pass; wider rows loop over blocks (two passes over the row)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_xa,
    stride_xb,
    stride_ra,
    stride_rb,
    rows_b,
    eps,
    N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    a = row // rows_b
    b = row % rows_b
    x_row = x_ptr + a.to(tl.int64) * stride_xa + b * stride_xb
    r_row = res_ptr + a.to(tl.int64) * stride_ra + b * stride_rb
    out_row = out_ptr + row.to(tl.int64) * N  # outputs are contiguous [rows, N]
    res_out_row = res_out_ptr + row.to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    if N <= BLOCK:
        # The whole row stays in registers between the reduction and the scaling.
        mask = cols < N
        h = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
            h = h.to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_row + cols, h, mask=mask)
            h = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, (h * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Pass 1: sum of squares (storing the summed residual); pass 2 re-reads and scales.
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, N, BLOCK):
            mask = start + cols < N
            h = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h += tl.load(r_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                h = h.to(res_out_ptr.dtype.element_ty)
                tl.store(res_out_row + start + cols, h, mask=mask)
                h = h.to(tl.float32)
            sq += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / N + eps)
        for start in range(0, N, BLOCK):
            mask = start + cols < N
            if HAS_RESIDUAL:
                h = tl.load(res_out_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                h = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + start + cols, (h * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


class AddRMSNormOutput(NamedTuple):
    """What the fused kernel returns: the normalised hidden states and the new residual stream."""

    normed: torch.Tensor  # norm(x + residual) * weight, in x's dtype
    residual: torch.Tensor  # x + residual, in residual's dtype: the next layer's residual


def _rows_view(x: torch.Tensor, name: str) -> tuple[int, int, int, int]:
    """(rows_a, rows_b, stride_a, stride_b) of a 1-, 2- or 3-d input with a unit last stride."""
    if x.dim() not in (1, 2, 3) or x.stride(-1) != 1:
        raise ValueError(f"rms_norm: {name} must be 1-, 2- or 3-d with a unit stride in the last dim, "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")
    if x.dim() == 1:
        return 1, 1, 0, 0
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float, max_block: int) -> None:
    if x.dim() not in (1, 2, 3):
        raise ValueError(f"rms_norm: x must be 1-, 2- or 3-d, got shape {tuple(x.shape)}")
    if max_block < 1 or max_block & (max_block - 1):
        raise ValueError(f"rms_norm: max_block must be a power of two, got {max_block}")
    if x.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"rms_norm: x and weight must be float32, bfloat16 or float16, got {x.dtype}, {weight.dtype}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or not weight.is_contiguous():
        raise ValueError(f"rms_norm: weight must be contiguous [{x.shape[-1]}], got {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError("rms_norm: x and weight must be on one device")
    if not eps > 0:
        raise ValueError(f"rms_norm: eps must be > 0, got {eps}")


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, res_out: torch.Tensor, max_block: int) -> None:
    rows_a, rows_b, sxa, sxb = _rows_view(x, "x")
    _, _, sra, srb = _rows_view(residual, "residual") if residual is not None else (0, 0, 0, 0)
    n = x.shape[-1]
    num_rows = rows_a * rows_b
    if num_rows == 0 or n == 0:
        return
    block = min(triton.next_power_of_2(n), max_block)
    _rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out, res_out,
        sxa, sxb, sra, srb, rows_b, eps,
        N=n,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=max(1, min(16, block // 256)),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, max_block: int = MAX_BLOCK) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim of a 1-3 d ``x`` (rows may be strided).

    Returns a new contiguous tensor in x's dtype. ``max_block`` caps the elements one pass holds
    (a power of two; only tests lower it, to exercise the two-pass path).
    """
    _check(x, weight, eps, max_block)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, out, max_block)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    max_block: int = MAX_BLOCK,
) -> AddRMSNormOutput:
    """``residual' = x + residual`` and ``norm(residual') * weight`` in one kernel.

    ``x`` and ``residual`` are ``[..., hidden]`` of one shape; both results are new contiguous
    tensors. Raises ValueError on mismatched shapes, dtypes or devices.
    """
    _check(x, weight, eps, max_block)
    if residual.shape != x.shape or residual.dtype not in FLOAT_DTYPES or residual.device != x.device:
        raise ValueError(f"fused_add_rms_norm: residual must match x {tuple(x.shape)} on {x.device}, got "
                         f"{tuple(residual.shape)} {residual.dtype} on {residual.device}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, res_out, max_block)
    return AddRMSNormOutput(out, res_out)
