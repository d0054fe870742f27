"""A persistent one-row gemv: a few programs an SM, each walking row tiles of the whole K.

Why: triton_gemv's default grid is one short program per row block (the 1B's gate_up: 4,096
programs of two K steps). On the H200 such a kernel loses 2-4 us against its bytes (gate_up
19.1 us against 15.9 at the copy bandwidth) while the lm_head, 30 times longer, loses nothing:
the cost is at the kernel's ends, the ramp and a tail of programs finishing unevenly. With a
prologue each of those programs also recomputes x from its inputs (``norm(x + residual)``:
12 KB of L2 reads a program for 16 KB of weights). Here the grid is ``programs_per_sm`` x SMs:

    program p:  x = prologue(inputs)            once, all of K, held in registers (float32)
                for tile in p, p + P, p + 2P, ...:   (pipelined: num_stages tiles in flight)
                    y = W[rows(tile), :] @ x         one [block_n, K] load, summed over K
                    epilogue(y)                      store, rotate + store K/V, SiLU, argmax

so every program streams the same bytes and the programs finish together, the next tiles are
on their way while one is reduced, and the prologue runs once a program. (Loading a program's
first tile before its prologue, so that its latency overlapped the prologue's, gained nothing.)
Measured on the H200 (lab/tools/bench_gemv_rows.py, the model's kernels with their prologues and epilogues): gate_up
18.4 us against the default's 21.1, lm_head 119.8 against 130.9, down 10.0 against 10.3; qkv
and o (8-12 MB) lose (6.2 against 5.7, 4.5 against 4.1).

Launched from triton_gemv's ``_launch`` when a config has ``programs_per_sm > 0`` (one row, FMA,
no split-K, ``block_k`` covering K); the epilogues are triton_gemv_epilogues'. It always
launches plainly, because as a programmatic dependent its programs crowd onto the SMs freed
first, measured as a loss (lab/notes/gpu_notes.md). Its ``pdl`` mode says
when it lets the kernel after it launch (TRIGGER): with an early mode ("preload",
"wait") once every program has started, so that a row-block gemv after it (down after gate_up)
has its programs resident and its first tiles loaded while this one streams, with a late one
after its tile loop; its own programs are all resident by then, so the dependent's only fill
what is left of each SM. Measured on the H200 at batch 1, neither trigger nor none made a
difference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from app.kernels.triton_gemv_epilogues import block_rows, rotate_and_store, silu_mul_store
from app.kernels.triton_greedy import argmax_key

# The prologues (triton_gemv's PROLOGUE values): none, silu(gate) * up, rms_norm(x + residual).
_SILU_MUL = tl.constexpr(1)
_ADD_RMS_NORM = tl.constexpr(2)
# When the kernel lets its programmatic dependents launch (TRIGGER; the launches pass .value).
TRIGGER_NONE = tl.constexpr(0)
TRIGGER_AT_START = tl.constexpr(1)
TRIGGER_AFTER_LOOP = tl.constexpr(2)


@triton.jit(do_not_specialize=["N", "rotary_programs"])
def gemv_rows_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    res_ptr,  # ADD_RMS_NORM: the residual [K] (HAS_RESIDUAL), the norm weight [K], where x + residual goes
    norm_w_ptr,
    res_out_ptr,
    cos_ptr,  # ROTARY: as triton_gemv's kernel
    sin_ptr,
    pos_ptr,
    loc_ptr,
    k_cache_ptr,
    v_cache_ptr,
    keys_ptr,  # ARGMAX: the row's [SLOTS] int64 argmax keys
    ids_ptr,  # EMBED: the token id whose row of x (the embedding table) is the input
    N,
    eps,
    stride_cos,
    stride_cache_slot,
    stride_cache_head,
    rotary_programs,  # ROTARY: the tiles of the q and k rows (the rest are v's)
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= K
    BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr,  # K == BLOCK_K and N % BLOCK_N == 0: no masks on the weight loads
    NUM_STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EMBED: tl.constexpr,  # ADD_RMS_NORM: x is row ids[0] of the table at x_ptr, stored as the residual
    ROTARY: tl.constexpr,
    HALF: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    SILU_OUT: tl.constexpr,
    ARGMAX: tl.constexpr,
    SLOTS: tl.constexpr,
    TRIGGER: tl.constexpr,  # TRIGGER_NONE, TRIGGER_AT_START or TRIGGER_AFTER_LOOP (PDL, CUDA only)
):
    if TRIGGER == TRIGGER_AT_START:  # the kernel after this one may launch (it waits for all of this one)
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_K)
    k_mask = cols < K
    if EMBED:
        x_ptr += tl.load(ids_ptr).to(tl.int64) * K
    slot = 0  # ROTARY: the token's KV slot and position, once a program (each tile's epilogue uses them)
    position = 0
    if ROTARY:
        slot = tl.load(loc_ptr).to(tl.int64)
        position = tl.load(pos_ptr).to(tl.int64)
    x = tl.load(x_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
    if PROLOGUE == _SILU_MUL:  # x is the gate; up sits K elements further on
        up = tl.load(x_ptr + K + cols, mask=k_mask, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    rms = 1.0
    if PROLOGUE == _ADD_RMS_NORM:
        # Loaded before the reduction, beside x: issued after it, its latency followed the
        # reduction's barrier (lab/tools/compile_check.py --order, sm_90).
        norm_w = tl.load(norm_w_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:  # h = x + residual, rounded to its dtype
            x += tl.load(res_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
            x = x.to(res_out_ptr.dtype.element_ty)
        if HAS_RESIDUAL or EMBED:  # h (EMBED: the embedding row) is the new residual: program 0 stores it
            tl.store(res_out_ptr + cols, x.to(res_out_ptr.dtype.element_ty), mask=cols < tl.where(pid == 0, K, 0))
            x = x.to(tl.float32)
        rms = tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
        x *= norm_w
    tiles = tl.cdiv(N, BLOCK_N)
    best = tl.full((), 0, tl.int64)  # ARGMAX: the best key of this program's tiles (keys are >= 0)
    for tile in tl.range(pid, tiles, programs, num_stages=NUM_STAGES):
        rows, head, first = block_rows(tile, N, rotary_programs, HALF, BLOCK_N, ROTARY, SILU_OUT)
        row_mask = rows < N
        w_tile = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
        if EVEN:
            w = tl.load(w_tile)
        else:
            w = tl.load(w_tile, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if PROLOGUE == _ADD_RMS_NORM:
            y = y / rms
        if ROTARY:
            rotate_and_store(y, rows, tile, rotary_programs, head, first, b_ptr, out_ptr, slot, position, cos_ptr,
                             sin_ptr, stride_cos, k_cache_ptr, v_cache_ptr, stride_cache_slot, stride_cache_head,
                             HAS_BIAS, HALF, NUM_Q_HEADS, BLOCK_N)
        elif SILU_OUT:
            silu_mul_store(y, rows, tile, b_ptr, out_ptr, HAS_BIAS, BLOCK_N)
        else:
            if HAS_BIAS:
                y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)
            if ARGMAX:  # of the logits as stored (rounded to the output dtype)
                stored = y.to(out_ptr.dtype.element_ty).to(tl.float32)
                best = tl.maximum(best, argmax_key(stored, rows, row_mask))
    if TRIGGER == TRIGGER_AFTER_LOOP:
        tl.extra.cuda.gdc_launch_dependents()
    if ARGMAX:  # one atomic a program (the row-block kernel: one a tile)
        tl.atomic_max(keys_ptr + pid % SLOTS, best)
