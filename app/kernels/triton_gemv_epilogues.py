"""The one-token epilogues of the gemv kernels (triton_gemv.py's row-block kernel and
triton_gemv_rows.py's persistent one): what a program does with its float32 sums instead of
storing them, so that the elementwise kernel after the projection disappears; and the rows a
block of outputs takes (:func:`block_rows`), which the epilogues depend on."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_rows(block, N, rotary_programs, HALF: tl.constexpr, BLOCK_N: tl.constexpr, ROTARY: tl.constexpr,
               SILU_OUT: tl.constexpr):
    """``(rows, head, first)``: the weight rows of output block ``block``. ROTARY: a q or k block
    takes BLOCK_N / 2 rotary pairs of one head (``head``), rows j.. and j + HALF.. from dim
    ``first`` (the two halves of rotate_half), the v blocks after them BLOCK_N rows in order;
    SILU_OUT: BLOCK_N / 2 gate rows j.. and the up rows j + N / 2.. that pair with them; else
    BLOCK_N rows in order (head and first 0 unless ROTARY)."""
    idx = tl.arange(0, BLOCK_N)
    pairs: tl.constexpr = BLOCK_N // 2
    head = 0
    first = 0
    if ROTARY:
        head = block // (HALF // pairs)
        first = (block % (HALF // pairs)) * pairs
        rows = tl.where(block < rotary_programs, head * (2 * HALF) + first + idx % pairs + (idx // pairs) * HALF,
                        block * BLOCK_N + idx)
    elif SILU_OUT:
        rows = block * pairs + idx % pairs + (idx // pairs) * (N // 2)
    else:
        rows = block * BLOCK_N + idx
    return rows, head, first


@triton.jit
def rotate_and_store(y, rows, pid_n, rotary_programs, head, first, b_ptr, out_ptr, slot, position, cos_ptr, sin_ptr,
                     stride_cos, k_cache_ptr, v_cache_ptr, stride_cache_slot, stride_cache_head,
                     HAS_BIAS: tl.constexpr, HALF: tl.constexpr, NUM_Q_HEADS: tl.constexpr, BLOCK_N: tl.constexpr):
    """ROTARY's epilogue for one token: q rows rotated into ``out`` (their own places), k rows
    rotated into the K cache and v rows into the V cache at the token's ``slot`` (int64). A q/k
    program (``head``, pairs from dim ``first``) has ``y`` = [first halves | second halves] of its
    pairs (the row map in the kernel) and rotates them by the cos/sin tables' row at ``position``.

    The kernels load the token's position (and slot) before their K loop and the tables here,
    after it: the epilogue then waits one round trip, not two (position, then table); the tables
    before the loop would stall the weights' loads behind the position's, since a warp issues in
    order (lab/tools/compile_check.py --order). Taking the row from a buffer before the loop instead
    gained nothing."""
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    pairs: tl.constexpr = BLOCK_N // 2
    if pid_n < rotary_programs:
        dims = first + tl.arange(0, pairs)
        cos = tl.load(cos_ptr + position * stride_cos + dims).to(tl.float32)
        sin = tl.load(sin_ptr + position * stride_cos + dims).to(tl.float32)
        x1, x2 = tl.split(tl.permute(tl.reshape(y, (2, pairs)), (1, 0)))
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        # Each branch stores through its own pointers: compiled triton needs a variable assigned in
        # both branches of a runtime `if` to have one type (shape and element type) in both.
        if head < NUM_Q_HEADS:
            q_dst = out_ptr + head * (2 * HALF) + dims
            tl.store(q_dst, o1.to(out_ptr.dtype.element_ty))
            tl.store(q_dst + HALF, o2.to(out_ptr.dtype.element_ty))
        else:
            k_dst = k_cache_ptr + slot * stride_cache_slot + (head - NUM_Q_HEADS) * stride_cache_head + dims
            tl.store(k_dst, o1.to(k_cache_ptr.dtype.element_ty))
            tl.store(k_dst + HALF, o2.to(k_cache_ptr.dtype.element_ty))
    else:
        v_rows = rows - rotary_programs * BLOCK_N  # within v: the q and k rows come first
        v_dst = v_cache_ptr + slot * stride_cache_slot + (v_rows // (2 * HALF)) * stride_cache_head + v_rows % (2 * HALF)
        tl.store(v_dst, y.to(v_cache_ptr.dtype.element_ty))


@triton.jit
def silu_mul_store(y, rows, pid_n, b_ptr, out_ptr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """SILU_OUT's epilogue for one token: the program's ``y`` = [gate rows | the same up rows]
    (the row map in the kernel), each rounded to the dtype as the stored projection would be,
    then ``silu(gate) * up`` (float32) rounded into ``out``'s ``BLOCK_N / 2`` columns."""
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    pairs: tl.constexpr = BLOCK_N // 2
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    gate, up = tl.split(tl.permute(tl.reshape(y, (2, pairs)), (1, 0)))
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + pid_n * pairs + tl.arange(0, pairs), act.to(out_ptr.dtype.element_ty))
