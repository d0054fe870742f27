"""Decode-shaped linear layers in triton: ``y[M, N] = x[M, K] @ W[N, K]^T (+ bias)`` for M <= 16.

Why: at batch 1 a decode step does 2 flops per bf16 weight it reads (1 flop per byte), so every
linear layer is bound by streaming its weight from HBM once (Llama-3.2-1B: 2.5 GB of linear
weights per token, lm_head included; at the H200's 4.23 TB/s copy bandwidth that is 0.58 ms,
~1,700 tok/s). cuBLAS matrix-vector products reach ~62 % of that bandwidth at M = 1. This kernel is built only to keep HBM busy: each weight
element is loaded once, in 16-byte vectors along its contiguous row, with enough programs (and
enough bytes in flight per program) to fill every SM even when N is small.

Algorithm (W row-major ``[N, K]``, our ``Linear`` layout)::

              K ->   split 0          split 1          (split_k = 2)
            +----------------+----------------+
    rows    | prog (0, 0)    | prog (0, 1)    |  <- block_n rows of W; each program walks its
    0..bn-1 |  [bn, bk] tile |  [bn, bk] tile |     K slice in block_k steps, x rows alongside
            |  -> -> ->      |  -> -> ->      |
            +----------------+----------------+
    rows    | prog (1, 0)    | prog (1, 1)    |
    bn..    |                |                |
            +----------------+----------------+
                    |                |
     split_k == 1:  y = acc (+ bias) -> out          (one kernel)
     split_k  > 1:  acc -> partial[split, M, N] fp32; a second kernel sums the splits in a fixed
                    order, adds the bias and casts: deterministic, no atomics, no zeroing.

Two ways to multiply a tile, both accumulating in float32:

* FMA (``use_dot=False``, M <= 4): ``acc_m[bn, bk] += w * x_m`` element-wise per x row, summed
  over bk once at the end. No layout conversions or shared memory; meant for M = 1-2.
* dot (``use_dot=True``): ``acc[16, bn] += x[16, bk] @ w[bn, bk]^T`` on tensor cores, x padded
  to 16 rows (masked loads, no traffic for the padding). Meant for larger M, where M FMAs per
  weight element would start to compete with the memory stream.

``num_stages > 1`` software-pipelines the K loop on either path (the weight tiles of the next
steps are copied to shared memory while the current one is used); 1 leaves the bytes in flight
to the number of resident programs.

Prologues (``fused-decode``: a batch-1 decode step in fewer kernels; M = 1, FMA path). The K
loop can compute its x slice from the tensors before it instead of reading a stored x, so the
elementwise kernel that would have written x disappears:

* :func:`gemv_silu_mul`: ``down_proj(silu(gate) * up)`` reads the ``[1, 2K]`` gate_up output; each
  step loads the gate and up slices and multiplies ``silu(g) * u`` (float32) into the weights.
* :func:`gemv_add_rms_norm`: ``linear(rms_norm(x + residual) * norm_weight)``.
  The inverse RMS is one scalar per row, so it factors out of the sum: the loop accumulates
  ``w * h * norm_weight`` and ``h * h`` side by side (h = x + residual, rounded to the dtype as
  fused_add_rms_norm rounds it) and scales the row's sum once at the end::

      y[n] = rstd * sum_k w[n, k] * h[k] * g[k]      rstd = 1 / sqrt(sum_k h[k]^2 / K + eps)

  No second pass over x and no wait before the weight stream starts. With split-K each split
  stores its partial sum of squares and the reduction applies rstd. The programs of the first
  row block write the new residual h (each its own K slice).

Epilogues of :func:`gemv_add_rms_norm` (one row, no split-K), instead of storing the plain row:
``rotary=`` rotates a qkv projection's q and k and stores K and V (``fused-qkv-rotary``),
``silu_mul=`` stores ``silu(gate) * up`` of a gate_up projection (the down projection after it
then has no prologue: ``fused-silu-out``), and ``argmax_keys=`` also folds the argmax of the
stored logits into a few int64 keys with one atomic per program (``fused-greedy``; the key
layout is in triton_greedy.py).

A config with ``programs_per_sm > 0`` runs the persistent kernel instead (one row, block_k
covering K: triton_gemv_rows.py), a few programs an SM that each compute x once and walk row
tiles; :func:`rows_config` gives its tiling (``gemv-rows``: gate_up and lm_head by default).
It always launches plainly, never as a programmatic dependent (``pdl`` is ignored there).

Launch parameters come from :func:`default_config`, a fixed heuristic of (M, N, K) and the SM
count (no autotuning: a run-time search would make start-up slow and CUDA-graph capture depend
on timings). :class:`GemvConfig` exposes every knob so a benchmark can sweep them
(lab/tools/bench_gemv.py). No launch depends on tensor values and no host sync happens, so
:func:`gemv` can be captured in a CUDA graph (the split-K scratch buffer is allocated by shape).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from app.kernels.pdl_modes import EARLY_TRIGGER_MODES, GEMV_PDL_MODES
from app.kernels.triton_gemv_epilogues import block_rows, rotate_and_store, silu_mul_store
from app.kernels.triton_gemv_rows import TRIGGER_AFTER_LOOP, TRIGGER_AT_START, TRIGGER_NONE, gemv_rows_kernel
from app.kernels.triton_greedy import ARGMAX_SLOTS, MAX_VOCAB, argmax_key
from app.kernels.triton_probe import check_probe, global_ns, record

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_M = 16  # rows of x; the dot path pads x to DOT_BLOCK_M rows
DOT_BLOCK_M = 16  # tensor-core dots need at least 16 rows
FMA_MAX_M = 4  # the FMA path keeps one accumulator tile per x row, written out for up to 4 rows
H200_SMS = 132  # SM count assumed when the device has none to ask (CPU, interpreter)
REDUCE_BLOCK = 1024  # outputs per program of the split-K reduction
# How a gemv launched as a programmatic dependent (pdl=...) overlaps the kernels around it
# (pdl_modes.py describes each); pdl=True is the first, "preload".
PDL_MODES = GEMV_PDL_MODES
# What the K loop computes x from (the kernels' PROLOGUE; see the module docstring). constexpr:
# globals that a kernel reads must be; the launches pass their ``.value``.
NO_PROLOGUE = tl.constexpr(0)
SILU_MUL = tl.constexpr(1)
ADD_RMS_NORM = tl.constexpr(2)


class GemvConfig(NamedTuple):
    """The launch knobs of :func:`gemv`; see the module docstring for the algorithm."""

    block_n: int  # rows of W per program (power of two; >= 16 with use_dot)
    block_k: int  # columns of W per loop step (power of two, >= 16)
    split_k: int = 1  # K slices run by separate programs; > 1 adds the reduction kernel
    use_dot: bool = False  # tensor-core dot over x padded to 16 rows, else FMA (M <= 4 only)
    num_warps: int = 4
    num_stages: int = 1  # software-pipelining depth of the K loop (1: none)
    # > 0: the persistent kernel (triton_gemv_rows.py), this many programs an SM, each walking
    # [block_n, K] row tiles (block_k covers K; num_stages pipelines the tile loop). One row only.
    programs_per_sm: int = 0

    def label(self) -> str:
        """A short name, e.g. ``fma n4 k1024 s1 w4 p1`` (``rows4 n2 k2048 w4 p3``: persistent)."""
        if self.programs_per_sm:
            return f"rows{self.programs_per_sm} n{self.block_n} k{self.block_k} w{self.num_warps} p{self.num_stages}"
        kind = "dot" if self.use_dot else "fma"
        return (f"{kind} n{self.block_n} k{self.block_k} s{self.split_k} "
                f"w{self.num_warps} p{self.num_stages}")


def _pow2(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def effective_split(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """``(splits, k_per_split)``: ``split_k`` K slices of whole ``block_k`` steps, none empty.

    Slices are ``ceil(steps / split_k)`` steps long, so fewer than ``split_k`` may be needed
    (e.g. 5 steps in 4 slices -> 2+2+1, three slices).
    """
    steps = triton.cdiv(k, block_k)
    per_split = triton.cdiv(steps, max(1, min(split_k, steps)))
    return triton.cdiv(steps, per_split), per_split * block_k


def split_for(n: int, k: int, block_n: int, block_k: int, num_sms: int = H200_SMS) -> int:
    """The heuristic's split-K for a tiling: 1 when the row blocks alone give at least 2 programs
    per SM, else enough K slices for ~4 programs per SM (at most one slice per K step)."""
    row_blocks = triton.cdiv(n, block_n)
    if row_blocks >= 2 * num_sms:
        return 1
    return effective_split(k, block_k, triton.cdiv(4 * num_sms, row_blocks))[0]


@functools.lru_cache(maxsize=4096)
def default_config(m: int, n: int, k: int, num_sms: int = H200_SMS) -> GemvConfig:
    """The launch configuration for an ``[m, k] x [n, k]^T`` product on ``num_sms`` SMs.

    * M <= 2: FMA. A 4096-element tile (32 weights per thread at 4 warps: 8 KB of bf16 loaded
      per step, ~60 registers, so ~8 programs fit on an SM), ``block_k`` up to 1024 (2 KB
      contiguous per row per step); ``block_n`` is halved (down to 1 row) until there are at
      least 4 programs per SM. No software pipelining: the bytes in flight come from the many
      resident programs.
    * M >= 3: dot, 16 x 256 weight tiles (8 KB a step) pipelined 3 deep. The FMA work of M
      rows per weight element would start to compete with the memory stream.
    * split-K as :func:`split_for` says. With 132 SMs the Llama-3 shapes need none at M <= 2
      (2048 x 2048 gets 1024 programs of 2 rows); at M >= 3 the 16-row blocks need 3-5
      slices for N <= 4096.
    """
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gemv: M must be in 1..{MAX_M}, got {m}")
    if n < 1 or k < 1 or num_sms < 1:
        raise ValueError(f"gemv: N, K and num_sms must be >= 1, got {n}, {k}, {num_sms}")
    if m <= 2:
        block_k = min(1024, max(64, triton.next_power_of_2(k)))
        block_n = 4096 // block_k
        while block_n > 1 and triton.cdiv(n, block_n) < 4 * num_sms:
            block_n //= 2
        use_dot, num_stages = False, 1
    else:
        block_n, block_k = DOT_BLOCK_M, min(256, max(16, triton.next_power_of_2(k)))
        use_dot, num_stages = True, 3
    split_k = split_for(n, k, block_n, block_k, num_sms)
    return GemvConfig(block_n, block_k, split_k, use_dot, num_warps=4, num_stages=num_stages)


@triton.jit
def _store_rows(y, m, rows, M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Write float32 sums ``y`` for x row(s) ``m`` and output columns ``rows`` (broadcastable):
    to the partial buffer of split ``pid_k``, or with the bias, cast, to the output."""
    mask = rows < tl.where(m < M, N, 0)  # (a scalar-and-vector `&` trips the interpreter)
    if SPLIT:
        tl.store(part_ptr + (pid_k * M + m) * N + rows, y, mask=mask)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * N + rows, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M of a BLOCK_M
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    res_ptr,  # ADD_RMS_NORM: the residual [K] (HAS_RESIDUAL), the norm weight [K], where x +
    norm_w_ptr,  # residual goes, and with SPLIT the splits' partial sums of squares [splits]
    res_out_ptr,
    sq_ptr,
    cos_ptr,  # ROTARY: the cos/sin tables [positions, HALF], the token's position and KV slot, the
    sin_ptr,  # layer's K and V caches [slots, kv_heads, 2 * HALF]
    pos_ptr,
    loc_ptr,
    k_cache_ptr,
    v_cache_ptr,
    keys_ptr,  # ARGMAX: the row's [ARGMAX_SLOTS] int64 argmax keys (see triton_greedy.py)
    ids_ptr,  # EMBED: the token id whose row of x (the embedding table) is the input
    probe_ptr,  # PROBE: the programs' records (triton_probe.py)
    M,
    N,
    K,
    stride_xm,
    k_per_split,  # a multiple of BLOCK_K
    eps,
    stride_cos,
    stride_cache_slot,
    stride_cache_head,
    rotary_programs,  # ROTARY: the programs of the q and k rows (the rest take v's)
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks on the weight loads
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PROLOGUE: tl.constexpr,  # NO_PROLOGUE, or SILU_MUL / ADD_RMS_NORM (FMA path, M = 1 only)
    HAS_RESIDUAL: tl.constexpr,
    EMBED: tl.constexpr,  # ADD_RMS_NORM: x is row ids[0] of the table at x_ptr, stored as the residual
    PDL_WAIT: tl.constexpr,  # launched as a programmatic dependent (FMA path): see gemv(pdl=...)
    PDL_PRELOAD: tl.constexpr,  # ... and loads its first weight tile before it waits
    PDL_TRIGGER_LATE: tl.constexpr,  # ... and lets the next kernel start only after its K loop
    ROTARY: tl.constexpr,  # the qkv projection of one token, rotated and stored: see gemv_add_rms_norm
    HALF: tl.constexpr,  # ROTARY: head_dim / 2
    NUM_Q_HEADS: tl.constexpr,  # ROTARY
    SILU_OUT: tl.constexpr,  # the gate_up projection of one token: silu(gate) * up stored, see gemv_add_rms_norm
    ARGMAX: tl.constexpr,  # M = 1, no split, no bias: fold the stored row's argmax into keys_ptr
    SLOTS: tl.constexpr,  # ARGMAX: ARGMAX_SLOTS
    PROBE: tl.constexpr,  # FMA path: record where and when each program ran (CUDA only)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PROBE:
        started = global_ns()
    rows, head, first = block_rows(pid_n, N, rotary_programs, HALF, BLOCK_N, ROTARY, SILU_OUT)
    cols = tl.arange(0, BLOCK_K)
    row_mask = rows < N
    k_start = pid_k * k_per_split
    steps = tl.cdiv(tl.minimum(K, k_start + k_per_split) - k_start, BLOCK_K)
    # Row starts are multiples of K: 16-byte aligned whenever K is a multiple of 8 (bf16).
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    if USE_DOT:
        ms = tl.arange(0, BLOCK_M)
        x_rows = x_ptr + ms[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in tl.range(0, steps, num_stages=NUM_STAGES):
            ks = k_start + i * BLOCK_K + cols
            if EVEN:
                w = tl.load(w_rows + ks[None, :])
            else:
                w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & (ks < K)[None, :], other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=(ms < M)[:, None] & (ks < K)[None, :], other=0.0)
            acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=DOT_PRECISION)
        _store_rows(acc, ms[:, None], rows[None, :], M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT)
    else:
        # One [BLOCK_N, BLOCK_K] accumulator per x row (up to 4), reduced over K once at the end.
        # Padding rows (M = 3 in BLOCK_M = 4) re-read the last row of x; their sums are not stored.
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        sq = tl.zeros((BLOCK_K,), dtype=tl.float32)  # ADD_RMS_NORM: h * h of this K slice
        if PDL_PRELOAD:
            # The weights depend on nothing the kernel before writes: load the first tile while it
            # finishes, then wait for it (its outputs are x).
            ks = k_start + cols
            if EVEN:
                w_first = tl.load(w_rows + ks[None, :])
            else:
                w_first = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & (ks < K)[None, :], other=0.0)
        if PDL_WAIT:
            # Every program waits for the previous kernel before it reads or writes anything else.
            tl.extra.cuda.gdc_wait()
            if not PDL_TRIGGER_LATE:
                tl.extra.cuda.gdc_launch_dependents()
        if PROBE:
            waited = global_ns()
        if EMBED:  # the token id is the previous kernel's output too: read after the wait
            x_ptr += tl.load(ids_ptr).to(tl.int64) * K
        if ROTARY:  # the token's slot and position now: their latency under the K loop's
            slot = tl.load(loc_ptr).to(tl.int64)
            position = tl.load(pos_ptr).to(tl.int64)
        for i in tl.range(0, steps, num_stages=NUM_STAGES):
            ks = k_start + i * BLOCK_K + cols
            k_mask = ks < K
            if PDL_PRELOAD:
                if i == 0:
                    w = w_first.to(tl.float32)
                elif EVEN:
                    w = tl.load(w_rows + ks[None, :]).to(tl.float32)
                else:
                    w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            elif EVEN:
                w = tl.load(w_rows + ks[None, :]).to(tl.float32)
            else:
                w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            x0 = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            # The prologues, inline: under triton's interpreter every call of a jit helper costs
            # about a millisecond, and this runs once per K step of every program.
            if PROLOGUE == SILU_MUL:  # x0 is the gate; up sits K elements further on
                up = tl.load(x_ptr + K + ks, mask=k_mask, other=0.0).to(tl.float32)
                x0 = x0 / (1.0 + tl.exp(-x0)) * up
            if PROLOGUE == ADD_RMS_NORM:
                if HAS_RESIDUAL:  # h = x + residual, rounded to its dtype
                    x0 += tl.load(res_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
                    x0 = x0.to(res_out_ptr.dtype.element_ty)
                if HAS_RESIDUAL or EMBED:  # h (EMBED: the embedding row) is the new residual: the first row block stores it
                    # (ks < K) & (pid_n == 0): a scalar-and-vector `&` trips the interpreter
                    tl.store(res_out_ptr + ks, x0.to(res_out_ptr.dtype.element_ty), mask=ks < tl.where(pid_n == 0, K, 0))
                    x0 = x0.to(tl.float32)
                sq += x0 * x0
                x0 *= tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            acc0 += w * x0[None, :]
            if BLOCK_M > 1:
                x1 = tl.load(x_ptr + tl.minimum(1, M - 1) * stride_xm + ks, mask=k_mask, other=0.0)
                acc1 += w * x1.to(tl.float32)[None, :]
            if BLOCK_M > 2:
                x2 = tl.load(x_ptr + tl.minimum(2, M - 1) * stride_xm + ks, mask=k_mask, other=0.0)
                acc2 += w * x2.to(tl.float32)[None, :]
            if BLOCK_M > 3:
                x3 = tl.load(x_ptr + tl.minimum(3, M - 1) * stride_xm + ks, mask=k_mask, other=0.0)
                acc3 += w * x3.to(tl.float32)[None, :]
        if PDL_WAIT:
            if PDL_TRIGGER_LATE:
                tl.extra.cuda.gdc_launch_dependents()
        y0 = tl.sum(acc0, axis=1)
        if PROLOGUE == ADD_RMS_NORM:
            if SPLIT:  # every row block holds the same sum for this K slice; the first stores it
                tl.store(sq_ptr + pid_k, tl.sum(sq, axis=0), mask=pid_n == 0)
            else:
                y0 = y0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
        if ROTARY:  # the cos/sin tables' row is loaded there, after the loop (see rotate_and_store)
            rotate_and_store(y0, rows, pid_n, rotary_programs, head, first, b_ptr, out_ptr, slot, position, cos_ptr,
                             sin_ptr, stride_cos, k_cache_ptr, v_cache_ptr, stride_cache_slot, stride_cache_head,
                             HAS_BIAS, HALF, NUM_Q_HEADS, BLOCK_N)
        elif SILU_OUT:
            silu_mul_store(y0, rows, pid_n, b_ptr, out_ptr, HAS_BIAS, BLOCK_N)
        else:
            _store_rows(y0, 0, rows, M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT)
        if ARGMAX:  # of the logits as stored (rounded to the output dtype): argmax of out, exactly
            stored = y0.to(out_ptr.dtype.element_ty).to(tl.float32)
            tl.atomic_max(keys_ptr + pid_n % SLOTS, argmax_key(stored, rows, rows < N))
        if BLOCK_M > 1:
            _store_rows(tl.sum(acc1, axis=1), 1, rows, M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT)
        if BLOCK_M > 2:
            _store_rows(tl.sum(acc2, axis=1), 2, rows, M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT)
        if BLOCK_M > 3:
            _store_rows(tl.sum(acc3, axis=1), 3, rows, M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT)
        if PROBE:
            record(probe_ptr, pid_k * tl.num_programs(0) + pid_n, started, waited)


@triton.jit
def _splitk_reduce_kernel(part_ptr, b_ptr, out_ptr, sq_ptr, M, N, K, splits, eps, HAS_BIAS: tl.constexpr,
                          RMS: tl.constexpr, BLOCK: tl.constexpr):
    """``out[m, cols] = sum_s partial[s, m, cols] (+ bias)``, splits summed in order 0, 1, ...;
    with ``RMS`` the sum is first scaled by 1 / sqrt(sum_s sq[s] / K + eps) (ADD_RMS_NORM, M = 1)."""
    m = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + (s * M + m) * N + cols, mask=mask, other=0.0)
    if RMS:
        sq = tl.load(sq_ptr)
        for s in range(1, splits):
            sq += tl.load(sq_ptr + s)
        acc = acc / tl.sqrt(sq / K + eps)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * N + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def device_sms(device: torch.device) -> int:
    """The SMs the launch heuristics divide the work among (a CPU, interpreted: the H200's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_SMS


def _check_config(config: GemvConfig, m: int, kernel: str = "gemv") -> None:
    if not (_pow2(config.block_n) and _pow2(config.block_k) and config.block_k >= 16):
        raise ValueError(f"{kernel}: block_n and block_k must be powers of two, block_k >= 16, got {config}")
    if config.use_dot and config.block_n < 16:
        raise ValueError(f"{kernel}: the dot path needs block_n >= 16, got {config}")
    if not config.use_dot and m > FMA_MAX_M:
        raise ValueError(f"{kernel}: the FMA path handles M <= {FMA_MAX_M}, got M = {m}; use use_dot=True")
    if config.split_k < 1 or not _pow2(config.num_warps) or config.num_warps > 16 or config.num_stages < 1:
        raise ValueError(f"{kernel}: need split_k >= 1, num_warps a power of two <= 16, num_stages >= 1, got {config}")


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str = "gemv",
                  x_name: str = "x", halves: int = 1, float32_x: bool = False) -> tuple[int, int, int]:
    """``(M, N, K)`` of ``x [M, halves * K]`` and ``weight [N, K]`` (halves 2: a [gate | up] input);
    ``float32_x``: x may also be float32 over a weight of another dtype (a fused MLP's sum)."""
    x_shape = "[M, K]" if halves == 1 else f"[M, {halves}K]"
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != halves * weight.shape[1]:
        raise ValueError(f"{kernel}: {x_name} must be {x_shape} and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    m, (n, k) = x.shape[0], weight.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{kernel}: M (rows of {x_name}) must be in 1..{MAX_M}, got {m}; use F.linear for larger batches")
    if n < 1 or k < 1:
        raise ValueError(f"{kernel}: N and K must be >= 1, got weight {tuple(weight.shape)}")
    if weight.dtype not in FLOAT_DTYPES or (weight.dtype != x.dtype and not (float32_x and x.dtype == torch.float32)):
        raise ValueError(f"{kernel}: {x_name} and weight must share one dtype of float32/bfloat16/float16, got "
                         f"{x.dtype}, {weight.dtype}")
    if not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"{kernel}: weight must be contiguous and {x_name} needs a unit stride along K, got strides "
                         f"{weight.stride()} and {x.stride()}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != weight.dtype or not bias.is_contiguous()):
        raise ValueError(f"{kernel}: bias must be contiguous [{n}] {weight.dtype}, got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    if len({t.device for t in (x, weight) + ((bias,) if bias is not None else ())}) != 1:
        raise ValueError(f"{kernel}: {x_name}, weight and bias must be on one device")
    return m, n, k


def _dot_operands(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The dot's operand dtype and precision: float32 stays exact (no TF32); bfloat16 is widened
    to float32 under triton's interpreter, whose dot misreads bfloat16 (exact: the products of
    two bfloat16 fit float32)."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and isinstance(_gemv_kernel, InterpretedFunction)):
        return tl.float32, "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32"


class _NormOperands(NamedTuple):
    """The ADD_RMS_NORM prologue's tensors (see :func:`gemv_add_rms_norm`)."""

    residual: torch.Tensor | None  # [1, K]; None: normalise x itself
    weight: torch.Tensor  # [K]
    eps: float
    residual_out: torch.Tensor  # [1, K]: where x + residual goes (unused without a residual)
    embed_ids: torch.Tensor | None = None  # [1]: x is an embedding table, the input its row ids[0]


class RotaryStore(NamedTuple):
    """Where :func:`gemv_add_rms_norm` sends a qkv projection of one token (``rotary=``): q and k
    rotated (neox layout) by the tables' row at ``positions[0]``, q into the output's q rows, k
    and v into the caches at slot ``loc[0]``. See :func:`rotary_store_fits` for the shapes."""

    cos: torch.Tensor  # float32 [max_positions, head_dim / 2] (triton_rotary.cos_sin_tables)
    sin: torch.Tensor
    positions: torch.Tensor  # int [1]
    loc: torch.Tensor  # int [1]: the token's KV slot
    k_cache: torch.Tensor  # one layer's [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    num_q_heads: int


def rotary_store_fits(num_q_heads: int, num_kv_heads: int, head_dim: int, hidden: int,
                      device: torch.device | None = None) -> bool:
    """Whether the qkv projection ``[(Hq + 2 Hk) * D, hidden]`` of one token can take the rotary
    epilogue with the default config: no split-K, rows per program even, dividing head_dim / 2
    (its pairs of one head) and the v rows."""
    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    config = default_config(1, n, hidden, device_sms(device) if device is not None else H200_SMS)
    return _rotary_config_fits(config, n, hidden, num_kv_heads, head_dim)


def _rotary_config_fits(config: GemvConfig, n: int, k: int, num_kv_heads: int, head_dim: int) -> bool:
    pairs = config.block_n // 2
    return (not config.use_dot and effective_split(k, config.block_k, config.split_k)[0] == 1 and pairs >= 1
            and head_dim % 2 == 0 and (head_dim // 2) % pairs == 0 and (num_kv_heads * head_dim) % config.block_n == 0
            and n % config.block_n == 0)


def _silu_config_fits(config: GemvConfig, n: int, k: int) -> bool:
    pairs = config.block_n // 2
    return (not config.use_dot and effective_split(k, config.block_k, config.split_k)[0] == 1 and pairs >= 1
            and n % 2 == 0 and (n // 2) % pairs == 0)


def silu_out_config(n: int, k: int, num_sms: int = H200_SMS) -> GemvConfig:
    """The default config of a one-row ``gate_up`` projection ``[n, k]`` with the silu_mul epilogue
    (:func:`gemv_add_rms_norm`): the default M = 1 tiling, unsplit, with block_n even and halved
    until block_n / 2 divides n / 2."""
    config = default_config(1, n, k, num_sms)
    block_n = max(2, config.block_n)
    while block_n > 2 and (n // 2) % (block_n // 2):
        block_n //= 2
    return config._replace(block_n=block_n, block_k=max(16, min(config.block_k, 4096 // block_n)), split_k=1,
                           use_dot=False, num_stages=1)


ROWS_MAX_K = 8192  # the persistent kernel holds x (all of K, float32) in registers


@functools.lru_cache(maxsize=4096)  # asked per layer of every eager one-token step
def rows_config(n: int, k: int, even: bool = False, max_block_n: int | None = None) -> GemvConfig | None:
    """The persistent kernel's config for a one-row ``[n, k]`` product (``even``: block_n even, as
    the rotary and SiLU epilogues need; ``max_block_n``: a power of two it must not pass, e.g. the
    rotary epilogue's head_dim), or None where it does not apply (K past ROWS_MAX_K).
    From lab/tools/bench_gemv_rows.py on the H200: tiles of 8 KB (16 KB at K = 8192), pipelined 3
    deep, 4 programs an SM (2 at K = 8192): gate_up 17.6 us, down 10.0 (the default 18.8, 10.3)."""
    block_k = triton.next_power_of_2(k)
    if block_k > ROWS_MAX_K:
        return None
    block_n = min(max(2 if even else 1, 4096 // block_k), max_block_n or n)
    if block_n < (2 if even else 1):
        return None
    return GemvConfig(block_n, block_k, 1, False, num_warps=4, num_stages=3,
                      programs_per_sm=4 if block_k <= 4096 else 2)


def argmax_config(n: int, k: int, num_sms: int = H200_SMS) -> GemvConfig:
    """The default config of a one-row output projection with the argmax epilogue (``argmax_keys``;
    it has the norm prologue too): 8 rows x 512 a program where that still gives 4 programs per
    SM, unsplit. Each program pays the prologue's x, residual and norm-weight loads, a second
    reduction and an atomic: on the H200 the 1B's lm_head took 147 us with the M = 1 default
    (4 x 1024, 32k programs) and 132 with 8 x 512 (bench_gemv --epilogues; plain, 121)."""
    config = default_config(1, n, k, num_sms)
    if triton.cdiv(n, 8) >= 4 * num_sms:
        config = config._replace(block_n=8, block_k=min(512, max(64, triton.next_power_of_2(k))))
    return config._replace(use_dot=False, split_k=1)


def _launch(
    kernel: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None,
    out: torch.Tensor | None,
    *,
    prologue: int = NO_PROLOGUE.value,
    norm: _NormOperands | None = None,
    pdl: bool | str = False,
    rotary: RotaryStore | None = None,
    argmax_keys: torch.Tensor | None = None,
    silu_out: bool = False,
    probe: torch.Tensor | None = None,
) -> torch.Tensor:
    """Check, pick the config, and run the kernel (and the split-K reduction) into ``out``."""
    halves = 2 if prologue == SILU_MUL.value else 1
    # A norm prologue may read a float32 x (a fused MLP's sum) over a residual of the weights' dtype.
    m, n, k = _check_inputs(x, weight, bias, kernel, "gate_up" if halves == 2 else "x", halves,
                            float32_x=prologue == ADD_RMS_NORM.value)
    dtype = weight.dtype
    if silu_out:
        if m != 1 or n % 2 or rotary is not None or argmax_keys is not None:
            raise ValueError(f"{kernel}: silu_mul takes one row and an even number of outputs (gate rows, then up "
                             f"rows), without rotary or argmax_keys; got M = {m}, N = {n}")
        config = silu_out_config(n, k, device_sms(x.device)) if config is None else config
        if not _silu_config_fits(config, n, k):
            raise ValueError(f"{kernel}: silu_mul needs an FMA config without split-K whose block_n is even and "
                             f"block_n / 2 divides N / 2; got {config} for [{n}, {k}]")
    if config is None:
        if argmax_keys is not None and m == 1:
            config = argmax_config(n, k, device_sms(x.device))
        else:
            config = default_config(m, n, k, device_sms(x.device))
    _check_config(config, m, kernel)
    if prologue != NO_PROLOGUE.value and (m != 1 or config.use_dot):
        raise ValueError(f"{kernel}: the prologue runs on the FMA path (use_dot=False) for one row, "
                         f"got M = {m} and {config}")
    if argmax_keys is not None:
        _check_argmax_keys(kernel, argmax_keys, m, n, bias, rotary, x.device)
        if config.use_dot or effective_split(k, config.block_k, config.split_k)[0] > 1:
            # The keys need each program's final sums: one K slice (only small vocabularies split).
            config = config._replace(use_dot=False, split_k=1)
    out_n = n // 2 if silu_out else n
    if out is None:
        out = torch.empty((m, out_n), dtype=dtype, device=x.device)
    elif out.shape != (m, out_n) or out.dtype != dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"{kernel}: out must be contiguous [{m}, {out_n}] {dtype} on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    splits, k_per_split = effective_split(k, config.block_k, config.split_k)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    sq = torch.empty(splits, dtype=torch.float32, device=x.device) if norm is not None and splits > 1 else part
    dot_dtype, dot_precision = _dot_operands(dtype)
    mode = PDL_MODES[0] if pdl is True else pdl
    if mode and mode not in PDL_MODES:
        raise ValueError(f"{kernel}: pdl must be a bool or one of {', '.join(PDL_MODES)}, got {pdl!r}")
    use_pdl = bool(mode) and not config.use_dot
    if use_pdl and x.device.type != "cuda":
        raise ValueError(f"{kernel}: pdl (programmatic dependent launch) needs a CUDA device, got {x.device}")
    # launch_pdl is passed only when on: triton's interpreter knows no such option.
    launch = {"launch_pdl": True} if use_pdl else {}
    rotary_programs, half, rot = 0, 1, rotary
    if rot is not None:
        head_dim, kv_heads = rot.k_cache.shape[2], rot.k_cache.shape[1]
        if not _rotary_config_fits(config, n, k, kv_heads, head_dim):
            raise ValueError(f"{kernel}: the rotary epilogue needs an FMA config without split-K whose block_n "
                             f"is even and divides head_dim / 2 and the v rows; got {config} for [{n}, {k}]")
        half = head_dim // 2
        rotary_programs = (rot.num_q_heads + kv_heads) * head_dim // config.block_n
    if probe is not None:
        if config.programs_per_sm or config.use_dot:
            raise ValueError(f"{kernel}: probe takes the row-block FMA kernel, got {config}")
        check_probe(probe, triton.cdiv(n, config.block_n) * splits, x.device, kernel)
    if config.programs_per_sm:  # never a programmatic dependent: see triton_gemv_rows.py
        trigger = TRIGGER_AT_START if mode in EARLY_TRIGGER_MODES else TRIGGER_AFTER_LOOP
        _launch_rows(x, weight, bias, config, out, prologue, norm, rot, rotary_programs, half, argmax_keys, silu_out,
                     (trigger if use_pdl else TRIGGER_NONE).value)
        return out
    _gemv_kernel[(triton.cdiv(n, config.block_n), splits)](
        x, weight, bias if bias is not None else out, out, part,
        norm.residual if norm is not None and norm.residual is not None else x,
        norm.weight if norm is not None else x,
        norm.residual_out if norm is not None else x,
        sq,
        *((rot.cos, rot.sin, rot.positions, rot.loc, rot.k_cache, rot.v_cache) if rot is not None else (x,) * 6),
        argmax_keys if argmax_keys is not None else x,
        norm.embed_ids if norm is not None and norm.embed_ids is not None else x,
        probe if probe is not None else x,
        m, n, k, x.stride(0), k_per_split, norm.eps if norm is not None else 0.0,
        rot.cos.stride(0) if rot is not None else 0,
        rot.k_cache.stride(0) if rot is not None else 0,
        rot.k_cache.stride(1) if rot is not None else 0,
        rotary_programs,
        HAS_BIAS=bias is not None,
        SPLIT=splits > 1,
        BLOCK_M=DOT_BLOCK_M if config.use_dot else triton.next_power_of_2(m),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        USE_DOT=config.use_dot,
        EVEN=n % config.block_n == 0 and k % config.block_k == 0,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        NUM_STAGES=config.num_stages,
        PDL_WAIT=use_pdl,
        PDL_PRELOAD=use_pdl and mode in ("preload", "late"),
        PDL_TRIGGER_LATE=use_pdl and mode in ("late", "wait-late"),
        PROBE=probe is not None,
        **_shared_meta(config, prologue, norm, rot, half, silu_out, argmax_keys),
        **launch,
    )
    if splits > 1:
        _splitk_reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK), m)](
            part, bias if bias is not None else out, out, sq, m, n, k, splits, norm.eps if norm is not None else 0.0,
            HAS_BIAS=bias is not None,
            RMS=norm is not None,
            BLOCK=REDUCE_BLOCK,
            num_warps=4,
        )
    return out


def _launch_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig,
                 out: torch.Tensor, prologue: int, norm: _NormOperands | None, rot: RotaryStore | None,
                 rotary_programs: int, half: int, argmax_keys: torch.Tensor | None, silu_out: bool,
                 trigger: int) -> None:
    """The persistent kernel (triton_gemv_rows.py) for a config with ``programs_per_sm``: launched
    plainly, whatever the caller's ``pdl``, which sets only when it lets the next kernel launch
    (``trigger``: the kernel's TRIGGER)."""
    n, k = weight.shape
    if x.shape[0] != 1 or config.use_dot or config.split_k != 1 or config.block_k < k or config.block_k > ROWS_MAX_K:
        raise ValueError(f"gemv: the persistent kernel takes one row, FMA, no split-K and block_k covering K "
                         f"(a power of two up to {ROWS_MAX_K}); got M = {x.shape[0]}, K = {k} and {config}")
    grid = (min(config.programs_per_sm * device_sms(x.device), triton.cdiv(n, config.block_n)),)
    gemv_rows_kernel[grid](
        x, weight, bias if bias is not None else out, out,
        norm.residual if norm is not None and norm.residual is not None else x,
        norm.weight if norm is not None else x,
        norm.residual_out if norm is not None else x,
        *((rot.cos, rot.sin, rot.positions, rot.loc, rot.k_cache, rot.v_cache) if rot is not None else (x,) * 6),
        argmax_keys if argmax_keys is not None else x,
        norm.embed_ids if norm is not None and norm.embed_ids is not None else x,
        n, norm.eps if norm is not None else 0.0,
        rot.cos.stride(0) if rot is not None else 0,
        rot.k_cache.stride(0) if rot is not None else 0,
        rot.k_cache.stride(1) if rot is not None else 0,
        rotary_programs,
        K=k,
        BLOCK_K=config.block_k,
        BLOCK_N=config.block_n,
        EVEN=k == config.block_k and n % config.block_n == 0,
        NUM_STAGES=config.num_stages,
        HAS_BIAS=bias is not None,
        TRIGGER=trigger,
        **_shared_meta(config, prologue, norm, rot, half, silu_out, argmax_keys),
    )


def _shared_meta(config: GemvConfig, prologue: int, norm: _NormOperands | None, rot: RotaryStore | None, half: int,
                 silu_out: bool, argmax_keys: torch.Tensor | None) -> dict:
    """The compile-time arguments and launch options that both gemv kernels take alike."""
    return dict(
        PROLOGUE=prologue,
        HAS_RESIDUAL=norm is not None and norm.residual is not None,
        EMBED=norm is not None and norm.embed_ids is not None,
        ROTARY=rot is not None,
        HALF=half,
        NUM_Q_HEADS=rot.num_q_heads if rot is not None else 0,
        SILU_OUT=silu_out,
        ARGMAX=argmax_keys is not None,
        SLOTS=ARGMAX_SLOTS,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
    pdl: bool | str = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [M, K]`` with 1 <= M <= 16 and a row-major ``weight [N, K]``.

    float32 accumulation; the result is ``[M, N]`` in x's dtype, written to ``out`` (contiguous,
    that shape and dtype) when given. ``config`` defaults to :func:`default_config` for the
    shape and the device's SM count. Raises ValueError on bad shapes, dtypes, layouts or configs.

    ``pdl`` (CUDA, compute capability 9.0 or newer; FMA row-block configs, else ignored): launch as a
    programmatic dependent of the kernel before it, so that the programs start, and (True or
    "preload", "late": see PDL_MODES) load their first weight tile, while that kernel finishes
    (a batch-1 step is ~100 small kernels, each otherwise paying its launch and ramp-up; see
    ``gemv-pdl``). Each program waits for the previous kernel (``griddepcontrol.wait``) before
    it reads x or writes anything, so ordering is as without it, and a kernel after this one
    waits for all of it.
    """
    return _launch("gemv", x, weight, bias, config, out, pdl=pdl)


def gemv_silu_mul(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
    pdl: bool | str = False,
) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T (+ bias)`` for one row ``gate_up [1, 2K]`` = ``[gate | up]``
    (the MLP's fused gate_up projection) and ``weight [N, K]``: the SiLU-and-mul kernel and the
    down projection in one. ``silu(gate) * up`` is computed in float32 as the K loop reads it and
    never stored (the unfused path rounds it to the model dtype first). Otherwise as :func:`gemv`;
    ``config`` (chosen for ``[1, K] x [N, K]``) must be an FMA one, as the default at M = 1 is;
    ``pdl`` as in :func:`gemv`."""
    return _launch("gemv_silu_mul", gate_up, weight, bias, config, out, prologue=SILU_MUL.value, pdl=pdl)


class NormGemvOutput(NamedTuple):
    """What :func:`gemv_add_rms_norm` returns."""

    out: torch.Tensor  # linear(norm(x + residual) * norm_weight): [1, N]
    residual: torch.Tensor  # x + residual, the residual stream after the add ([1, K]; x without a residual)


def gemv_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    pdl: bool | str = False,
    rotary: RotaryStore | None = None,
    argmax_keys: torch.Tensor | None = None,
    silu_mul: bool = False,
    embed_ids: torch.Tensor | None = None,
    probe: torch.Tensor | None = None,
) -> NormGemvOutput:
    """``h = x + residual`` and ``rms_norm(h) * norm_weight @ weight.T (+ bias)`` for one row
    ``x [1, K]``: triton_norm.fused_add_rms_norm and :func:`gemv` in one kernel (with no
    residual, rms_norm of x itself, which is then the residual returned). ``h`` is rounded to the
    dtype as fused_add_rms_norm rounds it; the normalised row stays float32 (the unfused path
    rounds it). ``config`` must be an FMA one (the default at M = 1). ``out`` and ``residual_out``
    (contiguous, of the results' shapes and dtype) receive the results when given (no residual:
    nothing is written, x is the residual). ``pdl`` as in :func:`gemv`.

    ``rotary`` (the qkv projection of a one-token decode step, ``fused-qkv-rotary``): instead of
    storing the projection, rotate its q and k rows (neox layout, float32, before rounding) and
    write q into ``out``'s q rows, k and v into the caches at the token's slot: the rotary + KV
    store kernel after it disappears. ``out``'s k and v rows are not written. Each program takes
    pairs of rows (j, j + head_dim / 2) of one head, so the config must fit
    (:func:`rotary_store_fits`, true for the Llama shapes' defaults). Raises ValueError on bad
    shapes, dtypes, layouts or configs.

    ``argmax_keys`` (``[1, ARGMAX_SLOTS]`` int64, empty: the output projection of a greedy
    batch-1 step, ``fused-greedy``): each program also folds the argmax of the logits it
    stores into the keys (triton_greedy.py), so that the step's token needs no pass over the
    vocabulary. Not with a bias or ``rotary``; a config with split-K runs unsplit.

    ``silu_mul`` (the MLP's gate_up projection ``[gate | up]`` of one token): store
    ``silu(gate) * up`` (``[1, N / 2]``) instead of the projection, so that the down projection
    after it is a plain :func:`gemv`: the SiLU is computed once per element, where
    :func:`gemv_silu_mul` recomputes it in every program of the down projection. Each program
    takes gate rows and the up rows that pair with them; gate and up are rounded to the dtype
    first, as the stored projection would be (the unfused path's SiLU-and-mul computes the same).
    The default config is :func:`silu_out_config`; an explicit one must fit it.

    ``embed_ids`` (``[1]`` int32/int64, the token of a one-token step; no ``residual``): ``x`` is
    the embedding table ``[V, K]`` and the input its row ``embed_ids[0]``, read by the kernel
    (after its PDL wait: the id may be the previous kernel's output), which also stores that row
    into ``residual_out`` (the residual stream's start): the embedding lookup before the first
    layer's qkv projection disappears. The id is not range-checked (no host sync).

    ``probe`` (CUDA, the row-block kernel; diagnostics for lab/tools/bench_fused_mlp.py): where and
    when each program ran (triton_probe.py), program ``pid_n`` at record ``pid_n``."""
    kernel = "gemv_add_rms_norm"
    if embed_ids is not None:
        x = _embedding_row(kernel, x, residual, embed_ids)
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"{kernel}: x must be one row [1, K], got {tuple(x.shape)}")
    dtype = weight.dtype  # of the residual and the results; x may be float32 (a fused MLP's sum)
    if residual is not None and (residual.shape != x.shape or residual.dtype != dtype
                                 or residual.stride(-1) != 1 or residual.device != x.device):
        raise ValueError(f"{kernel}: residual must be {tuple(x.shape)} {dtype} on {x.device} with a unit stride, "
                         f"got {tuple(residual.shape)} {residual.dtype} on {residual.device}")
    if x.dtype != dtype and not (x.dtype == torch.float32 and residual is not None):
        raise ValueError(f"{kernel}: x and weight must share one dtype of float32/bfloat16/float16 (x may be float32 "
                         f"over a residual of the weight's), got {x.dtype}, {weight.dtype}")
    if (norm_weight.shape != (x.shape[1],) or not norm_weight.is_contiguous() or norm_weight.dtype not in FLOAT_DTYPES
            or norm_weight.device != x.device):
        raise ValueError(f"{kernel}: norm_weight must be a contiguous float [{x.shape[1]}] on {x.device}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")
    if not eps > 0:
        raise ValueError(f"{kernel}: eps must be > 0, got {eps}")
    if residual is None and embed_ids is None:
        residual_out = x
    elif residual_out is None:
        residual_out = torch.empty(x.shape, dtype=dtype, device=x.device)
    elif residual_out.shape != x.shape or residual_out.dtype != dtype or not residual_out.is_contiguous() \
            or residual_out.device != x.device:
        raise ValueError(f"{kernel}: residual_out must be contiguous {tuple(x.shape)} {dtype} on {x.device}, got "
                         f"{tuple(residual_out.shape)} {residual_out.dtype} on {residual_out.device}")
    norm = _NormOperands(residual, norm_weight, eps, residual_out, embed_ids)
    if rotary is not None:
        _check_rotary_store(rotary, weight, x.device)
    out = _launch(kernel, x, weight, bias, config, out, prologue=ADD_RMS_NORM.value, norm=norm, pdl=pdl,
                  rotary=rotary, argmax_keys=argmax_keys, silu_out=silu_mul, probe=probe)
    return NormGemvOutput(out, residual_out)


def _embedding_row(kernel: str, table: torch.Tensor, residual: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """For ``embed_ids``: the table's first row, which the kernels offset by the id (its
    ``residual_out`` is then checked or made as with a residual). ValueError naming the problem."""
    if residual is not None:
        raise ValueError(f"{kernel}: embed_ids starts the residual stream: residual must be None")
    if table.dim() != 2 or not table.is_contiguous():
        raise ValueError(f"{kernel}: with embed_ids, x must be a contiguous embedding table [V, K], got "
                         f"{tuple(table.shape)} with strides {table.stride()}")
    if ids.shape != (1,) or ids.dtype not in (torch.int32, torch.int64) or ids.device != table.device:
        raise ValueError(f"{kernel}: embed_ids must be one int32/int64 id on {table.device}, got {tuple(ids.shape)} "
                         f"{ids.dtype} on {ids.device}")
    return table[:1]


def _check_argmax_keys(kernel: str, keys: torch.Tensor, m: int, n: int, bias: torch.Tensor | None,
                       rotary: RotaryStore | None, device: torch.device) -> None:
    if m != 1 or bias is not None or rotary is not None:
        raise ValueError(f"{kernel}: argmax_keys take one row without a bias or a rotary epilogue, got M = {m}"
                         f"{', a bias' if bias is not None else ''}{', rotary' if rotary is not None else ''}")
    if n > MAX_VOCAB:
        raise ValueError(f"{kernel}: argmax_keys index at most {MAX_VOCAB} outputs, got N = {n}")
    if keys.shape != (1, ARGMAX_SLOTS) or keys.dtype != torch.int64 or not keys.is_contiguous() or keys.device != device:
        raise ValueError(f"{kernel}: argmax_keys must be contiguous [1, {ARGMAX_SLOTS}] int64 on {device}, got "
                         f"{tuple(keys.shape)} {keys.dtype} on {keys.device}")


def _check_rotary_store(rotary: RotaryStore, weight: torch.Tensor, device: torch.device) -> None:
    kernel = "gemv_add_rms_norm"
    k_cache, v_cache = rotary.k_cache, rotary.v_cache
    if k_cache.dim() != 3 or v_cache.shape != k_cache.shape or k_cache.stride() != v_cache.stride() \
            or k_cache.stride(2) != 1 or k_cache.dtype != weight.dtype or v_cache.dtype != weight.dtype:
        raise ValueError(f"{kernel}: the rotary caches must be two [slots, kv_heads, head_dim] {weight.dtype} tensors "
                         f"of one layout, got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    if rotary.num_q_heads < 1 or weight.shape[0] != (rotary.num_q_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"{kernel}: weight rows {weight.shape[0]} are not (q heads {rotary.num_q_heads} + 2 x "
                         f"{kv_heads} kv heads) x head_dim {head_dim}")
    half = head_dim // 2
    if rotary.cos.dim() != 2 or rotary.cos.shape[1] != half or rotary.sin.shape != rotary.cos.shape \
            or rotary.cos.stride() != rotary.sin.stride() or rotary.cos.stride(1) != 1:
        raise ValueError(f"{kernel}: cos and sin must be [positions, {half}] tables of one layout, got "
                         f"{tuple(rotary.cos.shape)} and {tuple(rotary.sin.shape)}")
    if rotary.positions.numel() != 1 or rotary.loc.numel() != 1:
        raise ValueError(f"{kernel}: the rotary epilogue takes one token: positions and loc of one element, got "
                         f"{rotary.positions.numel()} and {rotary.loc.numel()}")
    tensors = (rotary.cos, rotary.sin, rotary.positions, rotary.loc, k_cache, v_cache)
    if any(t.device != device for t in tensors):
        raise ValueError(f"{kernel}: the rotary tensors must be on {device}")
