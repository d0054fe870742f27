"""The MLP's gate_up projection with SiLU-and-mul in its epilogue, for prefill-sized inputs.

A prefill step runs the MLP's gate_up projection (``x [M, K] @ W [2I, K]^T -> [M, 2I]``, gate
rows first, then up rows) and then SiLU-and-mul, which reads that ``[M, 2I]`` result back from
memory and writes ``[M, I]``: at 16 x 512 tokens of the 1B, 1.4 ms of a 26 ms prefill step
(docs/gpu_notes.md, lead 2). Here each program computes the same ``[BLOCK_M, BLOCK_N]`` block of
the gate half and of the up half (two accumulators over one x tile), rounds both to the
weights' dtype as the stored projection would be, and stores ``silu(gate) * up``: the ``[M, 2I]``
intermediate never exists, and the result equals the two-kernel path's up to the order of the
dot products' sums.

Grid: one program an output block, ordered in groups of GROUP_M block rows so that programs
running together share x and W tiles in L2 (the ordering of triton's matmul tutorial).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from app.kernels.checks import dot_operand_dtype

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GateUpSiluConfig(NamedTuple):
    """The launch knobs of :func:`gate_up_silu` (tools/bench_gate_up_silu.py sweeps them)."""

    block_m: int = 128  # rows of x a program (power of two, >= 16)
    block_n: int = 128  # outputs a program, of each half (power of two, >= 16)
    block_k: int = 64  # K a loop step (power of two, >= 16)
    group_m: int = 8  # block rows a group of the launch order
    num_warps: int = 8
    num_stages: int = 3  # software-pipelining depth of the K loop

    def label(self) -> str:
        return (f"m{self.block_m} n{self.block_n} k{self.block_k} g{self.group_m} "
                f"w{self.num_warps} s{self.num_stages}")


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,
    gate_ptr,  # the weight's gate rows [I, K]
    up_ptr,  # ... and its up rows [I, K], right after them
    out_ptr,
    M,
    I,
    K,
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN: tl.constexpr,  # M, I and K multiples of their blocks: no masks
    NUM_STAGES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # the operands' dtype (float32 for bfloat16 under the interpreter: checks.py)
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(I, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_offsets = cols.to(tl.int64)[:, None] * K + ks[None, :]
    gate_tile = gate_ptr + w_offsets
    up_tile = up_ptr + w_offsets
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN:
            x = tl.load(x_tile)
            gate_w = tl.load(gate_tile)
            up_w = tl.load(up_tile)
        else:
            k_mask = (k0 + ks) < K
            x = tl.load(x_tile, mask=(rows < M)[:, None] & k_mask[None, :], other=0.0)
            w_mask = (cols < I)[:, None] & k_mask[None, :]
            gate_w = tl.load(gate_tile, mask=w_mask, other=0.0)
            up_w = tl.load(up_tile, mask=w_mask, other=0.0)
        x = x.to(DOT_DTYPE)
        acc_gate = tl.dot(x, tl.trans(gate_w.to(DOT_DTYPE)), acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(x, tl.trans(up_w.to(DOT_DTYPE)), acc_up, input_precision=DOT_PRECISION)
        x_tile += BLOCK_K
        gate_tile += BLOCK_K
        up_tile += BLOCK_K

    # Rounded to the output dtype first, as the stored [M, 2I] projection would be.
    gate = acc_gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    out_tile = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    if EVEN:
        tl.store(out_tile, out.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_tile, out.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < I)[None, :])


def _power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, *, config: GateUpSiluConfig | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` for ``x [M, K]`` (unit stride along K) and the fused
    row-major ``weight [2I, K]`` (gate rows, then up rows) of one dtype (float32, bfloat16 or
    float16); float32 accumulation, each half rounded to the dtype before the SiLU (as the
    projection stored, then :func:`app.kernels.triton_activation.silu_and_mul`, computes it).
    Returns ``out`` (contiguous ``[M, I]`` of the dtype) or a new tensor. Raises ValueError on
    bad shapes, dtypes, layouts or configs."""
    config = config or GateUpSiluConfig()
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or weight.shape[0] % 2:
        raise ValueError(f"gate_up_silu: x must be [M, K] and weight [2I, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"gate_up_silu: x and weight must share one dtype of float32/bfloat16/float16, got {x.dtype}, "
                         f"{weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"gate_up_silu: x and weight must be on one device, got {x.device} and {weight.device}")
    if (x.shape[1] and x.stride(1) != 1) or not weight.is_contiguous():
        raise ValueError("gate_up_silu: x needs a unit stride along K and weight must be contiguous")
    blocks = (config.block_m, config.block_n, config.block_k)
    if not all(_power_of_two(b) and b >= 16 for b in blocks) or config.group_m < 1 or config.num_stages < 1 \
            or not _power_of_two(config.num_warps):
        raise ValueError(f"gate_up_silu: blocks must be powers of two >= 16, group_m and num_stages >= 1 and "
                         f"num_warps a power of two, got {config}")
    m, k = x.shape
    inter = weight.shape[0] // 2
    if out is None:
        out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    elif out.shape != (m, inter) or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"gate_up_silu: out must be contiguous [{m}, {inter}] {x.dtype} on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if m == 0 or inter == 0:
        return out
    if k == 0:
        return out.zero_()  # silu(0) * 0
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(inter, config.block_n),)
    _gate_up_silu_kernel[grid](
        x, weight, weight[inter:], out, m, inter, k, x.stride(0), out.stride(0),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        EVEN=m % config.block_m == 0 and inter % config.block_n == 0 and k % config.block_k == 0,
        NUM_STAGES=config.num_stages,
        DOT_DTYPE=dot_operand_dtype(x.dtype, _gate_up_silu_kernel),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
