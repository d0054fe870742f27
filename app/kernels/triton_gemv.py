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

Launch parameters come from :func:`default_config`, a fixed heuristic of (M, N, K) and the SM
count (no autotuning: a run-time search would make start-up slow and CUDA-graph capture depend
on timings). :class:`GemvConfig` exposes every knob so a benchmark can sweep them
(tools/bench_gemv.py). No launch depends on tensor values and no host sync happens, so
:func:`gemv` can be captured in a CUDA graph (the split-K scratch buffer is allocated by shape).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_M = 16  # rows of x; the dot path pads x to DOT_BLOCK_M rows
DOT_BLOCK_M = 16  # tensor-core dots need at least 16 rows
FMA_MAX_M = 4  # the FMA path keeps one accumulator tile per x row, written out for up to 4 rows
H200_SMS = 132  # SM count assumed when the device has none to ask (CPU, interpreter)
REDUCE_BLOCK = 1024  # outputs per program of the split-K reduction


class GemvConfig(NamedTuple):
    """The launch knobs of :func:`gemv`; see the module docstring for the algorithm."""

    block_n: int  # rows of W per program (power of two; >= 16 with use_dot)
    block_k: int  # columns of W per loop step (power of two, >= 16)
    split_k: int = 1  # K slices run by separate programs; > 1 adds the reduction kernel
    use_dot: bool = False  # tensor-core dot over x padded to 16 rows, else FMA (M <= 4 only)
    num_warps: int = 4
    num_stages: int = 1  # software-pipelining depth of the K loop (1: none)

    def label(self) -> str:
        """A short name, e.g. ``fma n4 k1024 s1 w4 p1``."""
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
    M,
    N,
    K,
    stride_xm,
    k_per_split,  # a multiple of BLOCK_K
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
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
        for i in tl.range(0, steps, num_stages=NUM_STAGES):
            ks = k_start + i * BLOCK_K + cols
            k_mask = ks < K
            if EVEN:
                w = tl.load(w_rows + ks[None, :]).to(tl.float32)
            else:
                w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc0 += w * tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            if BLOCK_M > 1:
                x1 = tl.load(x_ptr + tl.minimum(1, M - 1) * stride_xm + ks, mask=k_mask, other=0.0)
                acc1 += w * x1.to(tl.float32)[None, :]
            if BLOCK_M > 2:
                x2 = tl.load(x_ptr + tl.minimum(2, M - 1) * stride_xm + ks, mask=k_mask, other=0.0)
                acc2 += w * x2.to(tl.float32)[None, :]
            if BLOCK_M > 3:
                x3 = tl.load(x_ptr + tl.minimum(3, M - 1) * stride_xm + ks, mask=k_mask, other=0.0)
                acc3 += w * x3.to(tl.float32)[None, :]
        _store_rows(tl.sum(acc0, axis=1), 0, rows, M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT)
        if BLOCK_M > 1:
            _store_rows(tl.sum(acc1, axis=1), 1, rows, M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT)
        if BLOCK_M > 2:
            _store_rows(tl.sum(acc2, axis=1), 2, rows, M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT)
        if BLOCK_M > 3:
            _store_rows(tl.sum(acc3, axis=1), 3, rows, M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT)


@triton.jit
def _splitk_reduce_kernel(part_ptr, b_ptr, out_ptr, M, N, splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``out[m, cols] = sum_s partial[s, m, cols] (+ bias)``, splits summed in order 0, 1, ..."""
    m = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + (s * M + m) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * N + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _device_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_SMS


def _check_config(config: GemvConfig, m: int) -> None:
    if not (_pow2(config.block_n) and _pow2(config.block_k) and config.block_k >= 16):
        raise ValueError(f"gemv: block_n and block_k must be powers of two, block_k >= 16, got {config}")
    if config.use_dot and config.block_n < 16:
        raise ValueError(f"gemv: the dot path needs block_n >= 16, got {config}")
    if not config.use_dot and m > FMA_MAX_M:
        raise ValueError(f"gemv: the FMA path handles M <= {FMA_MAX_M}, got M = {m}; use use_dot=True")
    if config.split_k < 1 or not _pow2(config.num_warps) or config.num_warps > 16 or config.num_stages < 1:
        raise ValueError(f"gemv: need split_k >= 1, num_warps a power of two <= 16, num_stages >= 1, got {config}")


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int, int]:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    (m, k), n = x.shape, weight.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gemv: M (rows of x) must be in 1..{MAX_M}, got {m}; use F.linear for larger batches")
    if n < 1 or k < 1:
        raise ValueError(f"gemv: N and K must be >= 1, got weight {tuple(weight.shape)}")
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"gemv: x and weight must share one dtype of float32/bfloat16/float16, got "
                         f"{x.dtype}, {weight.dtype}")
    if not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"gemv: weight must be contiguous and x needs a unit stride along K, got strides "
                         f"{weight.stride()} and {x.stride()}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"gemv: bias must be contiguous [{n}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if len({t.device for t in (x, weight) + ((bias,) if bias is not None else ())}) != 1:
        raise ValueError("gemv: x, weight and bias must be on one device")
    return m, n, k


def _dot_operands(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The dot's operand dtype and precision: float32 stays exact (no TF32); bfloat16 is widened
    to float32 under triton's interpreter, whose dot misreads bfloat16 (exact: the products of
    two bfloat16 fit float32)."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and isinstance(_gemv_kernel, InterpretedFunction)):
        return tl.float32, "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32"


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [M, K]`` with 1 <= M <= 16 and a row-major ``weight [N, K]``.

    float32 accumulation; the result is ``[M, N]`` in x's dtype, written to ``out`` (contiguous,
    that shape and dtype) when given. ``config`` defaults to :func:`default_config` for the
    shape and the device's SM count. Raises ValueError on bad shapes, dtypes, layouts or configs.
    """
    m, n, k = _check_inputs(x, weight, bias)
    if config is None:
        config = default_config(m, n, k, _device_sms(x.device))
    _check_config(config, m)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"gemv: out must be contiguous [{m}, {n}] {x.dtype} on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    splits, k_per_split = effective_split(k, config.block_k, config.split_k)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    dot_dtype, dot_precision = _dot_operands(x.dtype)
    _gemv_kernel[(triton.cdiv(n, config.block_n), splits)](
        x, weight, bias if bias is not None else out, out, part,
        m, n, k, x.stride(0), k_per_split,
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
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        _splitk_reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK), m)](
            part, bias if bias is not None else out, out, m, n, splits,
            HAS_BIAS=bias is not None,
            BLOCK=REDUCE_BLOCK,
            num_warps=4,
        )
    return out
