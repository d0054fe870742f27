"""The decode attention's split merge inside the o projection, for a step of one token.

Why: at batch 1 the split-KV decode attention runs two kernels a layer, stage 1 (3.9 us on the
H200) and stage 2 (2.3 us, which merges each head's splits: a few KB, the time is all launch
and latency), then o's gemv (2.8 us against 2.0 of bytes); docs/gpu_notes.md, lead 1 (c). o's
row-block gemv needs every head's merged output in each program, so folding stage 2 into it
would have every program merge all the heads. Split by head instead, a program needs only its
own head's splits, and o is linear in the heads:

    program (head h, rows r):  w = W_o[r, h * D:(h + 1) * D]         loaded first: needs nothing
                               [programmatic dependent: wait for stage 1 here]
                               attn_h = merge(mid_o[h, :S], mid_lse[h, :S])   as stage 2 does
                               atomic_add(out[r], w @ attn_h)                 float32

so stage 2's kernel goes, and with stage 1 triggering at its start (``decode_attention(partials=
True, trigger_dependents=True)``) every program has its weights in registers before stage 1
ends: all of W_o (8 MB for the 1B) loads under the attention.

``out`` (``[1, N]`` float32) must be zero before the launch: the next kernel reads the sum as its
x over the residual (the fused MLP or gemv_add_rms_norm take a float32 x). ``zero`` (another
such buffer, if given) is set to zero by the head-0 programs, so that buffers taken in turn by
consecutive layers are zero again before their next use (as the fused MLP's sums; see
LlamaForCausalLM's ``_layer_sums``).

Rounding follows the two-kernel path's: each head's merged output is rounded to the weights'
dtype as stage 2 stores it; the heads' sum is float32 in another order (atomics, differing from
run to run in the last bits) and not rounded to the dtype before the residual add.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from app.kernels.triton_decode import DecodePartials


class MergeOConfig(NamedTuple):
    """Rows of W_o a program takes for its head, and its warps."""

    # tools/bench_merge_o.py on the H200 (11-30), µs a layer of the 1B at 640 / 1,152 keys, against
    # stage 1 + stage 2 + o's gemv at 8.21 / 9.71: 64 rows at 1 warp (no block barriers in the
    # merge) 7.81 / 9.69, at 4 warps 8.35 / 10.09; stage 1 letting the merge in after its key loop
    # instead of at its start, or a plain launch, 0.9–1.6 slower.
    block_n: int = 64
    num_warps: int = 1


@triton.jit(do_not_specialize=["min_split_len"])
def _merge_o_kernel(
    mid_o_ptr,  # [1, H, S, D] float32
    mid_lse_ptr,  # [1, H, S] float32
    seq_lens_ptr,
    w_ptr,  # [N, H * D]
    out_acc_ptr,  # [N] float32, zero
    zero_ptr,  # [N] float32: set to zero by the head-0 programs
    min_split_len,
    N,
    stride_moh,
    stride_mos,
    stride_mlh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    PDL_WAIT: tl.constexpr,  # launched as a programmatic dependent of stage 1
):
    head = tl.program_id(0) % NUM_HEADS
    rows = (tl.program_id(0) // NUM_HEADS) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < N
    d_mask = dims < HEAD_DIM
    k = NUM_HEADS * HEAD_DIM
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * k + head * HEAD_DIM + dims[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if HAS_ZERO:  # another layer's sum, read before this kernel's stage 1 began
        tl.store(zero_ptr + rows, tl.zeros((BLOCK_N,), tl.float32), mask=rows < tl.where(head == 0, N, 0))
    if PDL_WAIT:
        tl.extra.cuda.gdc_wait()
    # Stage 2's merge for this head: every split loaded at once beside the length.
    s = tl.arange(0, BLOCK_S)
    in_grid = s < MAX_SPLITS
    lse_all = tl.load(mid_lse_ptr + head * stride_mlh + s, mask=in_grid, other=float("-inf"))
    parts_all = tl.load(mid_o_ptr + head * stride_moh + s[:, None] * stride_mos + dims[None, :],
                        mask=in_grid[:, None] & d_mask[None, :], other=0.0)
    seq_len = tl.load(seq_lens_ptr).to(tl.int32)
    num_splits = tl.minimum(tl.maximum(tl.cdiv(seq_len, min_split_len), 1), MAX_SPLITS)
    split_len = tl.cdiv(seq_len, num_splits)
    s_mask = (s < num_splits) & in_grid & (s * split_len < seq_len)  # the splits stage 1 wrote
    lse = tl.where(s_mask, lse_all, float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    weights = tl.where(s_mask, tl.exp2(lse - m), 0.0)
    total = tl.sum(weights, axis=0)
    attn = tl.sum(weights[:, None] * tl.where(s_mask[:, None], parts_all, 0.0), axis=0)
    attn = (attn / tl.where(total > 0, total, 1.0)).to(w.dtype).to(tl.float32)  # as stage 2 stores it
    y = tl.sum(w.to(tl.float32) * attn[None, :], axis=1)
    tl.atomic_add(out_acc_ptr + rows, y, mask=row_mask, sem="relaxed")


def merge_o_fits(num_heads: int, head_dim: int, max_kv_splits: int) -> bool:
    """Whether :func:`merge_o_proj` takes this attention (a head's splits in one program's registers)."""
    return num_heads >= 1 and 1 <= head_dim <= 256 and 1 <= max_kv_splits <= 64


def merge_o_proj(
    partials: DecodePartials,
    weight: torch.Tensor,
    out: torch.Tensor,
    *,
    zero: torch.Tensor | None = None,
    pdl: bool = False,
    config: MergeOConfig = MergeOConfig(),
) -> torch.Tensor:
    """``o_proj(attention)`` of one token from stage 1's ``partials`` (see the module docstring),
    added into ``out`` (``[1, N]`` float32, zero before), which it returns. ``weight``: o's
    ``[N, H * D]``, no bias. ``pdl`` (CUDA): launch as a programmatic dependent (of stage 1
    launched with ``trigger_dependents``). Raises ValueError on bad shapes, dtypes or devices."""
    kernel = "merge_o_proj"
    mid_o, mid_lse, seq_lens = partials.mid_o, partials.mid_lse, partials.seq_lens
    if mid_o.dim() != 4 or mid_o.shape[0] != 1 or mid_o.dtype != torch.float32 or mid_o.stride(-1) != 1:
        raise ValueError(f"{kernel}: mid_o must be float32 [1, H, S, D] with a unit stride, got "
                         f"{tuple(mid_o.shape)} {mid_o.dtype}")
    _, num_heads, max_splits, head_dim = mid_o.shape
    if mid_lse.shape != (1, num_heads, max_splits) or mid_lse.dtype != torch.float32 or mid_lse.stride(-1) != 1:
        raise ValueError(f"{kernel}: mid_lse must be float32 [1, {num_heads}, {max_splits}], got "
                         f"{tuple(mid_lse.shape)} {mid_lse.dtype}")
    if seq_lens.shape != (1,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{kernel}: seq_lens must be int32/int64 [1], got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if not merge_o_fits(num_heads, head_dim, max_splits) or partials.min_split_len < 1:
        raise ValueError(f"{kernel}: {num_heads} heads of {head_dim} at {max_splits} splits (min length "
                         f"{partials.min_split_len}) do not fit")
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != num_heads * head_dim or not weight.is_contiguous():
        raise ValueError(f"{kernel}: weight must be a contiguous [N, {num_heads * head_dim}], got {tuple(weight.shape)}")
    for name, buffer in (("out", out), ("zero", zero)):
        if buffer is not None and (buffer.shape != (1, n) or buffer.dtype != torch.float32
                                   or not buffer.is_contiguous()):
            raise ValueError(f"{kernel}: {name} must be a contiguous [1, {n}] float32, got {tuple(buffer.shape)} "
                             f"{buffer.dtype}")
    if zero is not None and zero.data_ptr() == out.data_ptr():
        raise ValueError(f"{kernel}: zero must be another buffer than out")
    if config.block_n < 1 or config.block_n & (config.block_n - 1) or config.num_warps not in (1, 2, 4, 8):
        raise ValueError(f"{kernel}: block_n must be a power of two and num_warps 1, 2, 4 or 8, got {config}")
    tensors = (mid_o, mid_lse, seq_lens, weight, out) + ((zero,) if zero is not None else ())
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{kernel}: every tensor must be on one device")
    if pdl and weight.device.type != "cuda":
        raise ValueError(f"{kernel}: pdl (programmatic dependent launch) needs a CUDA device, got {weight.device}")
    # launch_pdl is passed only when on: triton's interpreter knows no such option.
    launch = {"launch_pdl": True} if pdl else {}
    grid = (num_heads * triton.cdiv(n, config.block_n),)
    _merge_o_kernel[grid](
        mid_o, mid_lse, seq_lens, weight, out, zero if zero is not None else out, partials.min_split_len, n,
        mid_o.stride(1), mid_o.stride(2), mid_lse.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        MAX_SPLITS=max_splits,
        BLOCK_S=max(2, triton.next_power_of_2(max_splits)),
        BLOCK_N=config.block_n,
        HAS_ZERO=zero is not None,
        PDL_WAIT=pdl,
        num_warps=config.num_warps,
        **launch,
    )
    return out
