"""Triton SiLU-and-mul: ``silu(gate) * up`` over the fused gate_up projection ``[..., 2 * I]``.

The MLP's gate and up halves come out of one matmul side by side; one kernel reads both halves
and writes ``[..., I]``, instead of a split, a SiLU and a multiply that each go through memory.
Computed in float32, stored in the input dtype. Grid: (rows, column blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, I: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * I + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` ``[..., 2 * I]``; a new contiguous ``[..., I]``.

    Rows may be strided (any leading shape that flattens to rows without a copy); the last dim
    must be contiguous. Raises ValueError on an odd last dim, a non-float dtype or a layout it
    cannot address.
    """
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim must be even (gate and up halves), got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"silu_and_mul: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul: x needs a unit stride in its last dim")
    inter = x.shape[-1] // 2
    try:
        rows = x.view(-1, x.shape[-1])
    except RuntimeError as exc:
        raise ValueError(f"silu_and_mul: the leading dims of {tuple(x.shape)} strides {x.stride()} do not flatten") from exc
    out = torch.empty(x.shape[:-1] + (inter,), dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0 or inter == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out, rows.stride(0), I=inter, BLOCK=block, num_warps=4
    )
    return out
