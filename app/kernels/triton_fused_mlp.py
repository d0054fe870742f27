"""A batch-1 MLP in one persistent kernel: ``down(silu(gate) * up)`` of ``rms_norm(x + residual)``.

Why: the 1B's decode step runs gate_up (67 MB) and down (34 MB) as two kernels, 18.4 and 9.8 us a
layer against 15.6 and 7.8 of bytes at the copy bandwidth (docs/gpu_notes.md, variant 70): each
kernel pays its own ramp and tail, and down's programs start only once every SiLU output exists,
because each of down's rows needs all of them. Split by the intermediate index instead, the down
projection needs nothing but the activations a program has just made:

    program p:  x = rms_norm(x + residual) * norm_weight      once, all of K (as triton_gemv_rows)
                acc[K] = 0                                    float32, in registers
                for tile in p, p + P, ...:                    (pipelined: num_stages tiles in flight)
                    g, u = W_gate_up[rows(tile), :] @ x       the tile's gate rows and their up rows
                    a = silu(g) * u                           BLOCK_N / 2 activations
                    acc += a @ W_down_t[tile's activations, :]   rows of down's transpose: contiguous
                atomic_add(out[K], acc)                       one float32 add per element a program

``W_down_t`` is down's weight transposed (``[intermediate, K]``: the model stores it so, see
LlamaForCausalLM.prepare_decode_weights), so the rows a tile needs are contiguous. The result
is a float32 sum in ``out``, which must be zero before the launch: the next kernel reads it as
its x (gemv_add_rms_norm takes a float32 x over a residual of the model's dtype). ``zero``
(another ``[K]`` float32 buffer, if given) is set to zero by program 0, so that buffers taken
in turn by consecutive layers are each zero again before their next use: the model has each
layer zero its predecessor's sum, which this layer's own qkv kernel has read by then.

Programs: at most ``programs_per_sm`` an SM (one, with three tiles in flight: twice as many
programs with two each ran 0.6 us a layer slower, their atomics twice as many), and of those the
most that walk the same number of tiles (:func:`even_programs`): a last round of tiles on half
the programs cost 0.4 us a layer.

Rounding follows the two-kernel path's: gate and up rounded to the dtype, silu(gate) * up
rounded to it; only the order of down's float32 sum differs (and it is not rounded to the dtype
before the next layer's residual add), so results match the unfused path within float32
rounding, not bit for bit, and differ from run to run in the last bits (the atomics' order).

``trigger`` (CUDA): let the kernel after this one launch as a programmatic dependent once this
one's tile loop is done (as the persistent gemv's late trigger), or with ``trigger_at_start`` at
each program's start, so that the next kernel's programs are resident beside this one's (one an
SM, registers to spare) and waiting when it ends, instead of launching ~0.7 us after its last
program (tools/bench_fused_mlp.py --before-qkv --probe). Launched plainly by the model:
as o's programmatic dependent (``dependent``: each program waits, ``griddepcontrol.wait``,
before reading x; with ``early_tile`` after its first tile's loads) the kernel streamed 10 us a
layer slower on the H200 (docs/gpu_notes.md, variant 88); ``dependent`` stays for
tools/bench_fused_mlp.py's ``--after-o``, which looks for why.

``fold_o`` (:class:`FoldO`, variant 101): o's projection runs inside the kernel too, before the
MLP. x is then the attention's output ``[1, Q]``; each program computes ``O_ROWS`` of o's rows
(their weights loaded before the programmatic wait, as o's gemv preloads them), stores them,
loads its first MLP tile and meets the others at a grid barrier; past it every program reads o's
whole output as the MLP's x. The o -> MLP boundary is the layer's one plain launch between two
weight streams (2.4 us against a barrier's 1.0-1.2, tools/bench_stream_boundary.py), and the
first tile's latency goes under the barrier. The barrier needs every program resident at once
(:func:`_all_resident` checks the compiled kernel; else, and under the interpreter, which runs
programs one after another, two launches: o's rows, then the MLP).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from app.kernels.triton_gemv import device_sms
from app.kernels.triton_gemv_epilogues import block_rows
from app.kernels.triton_probe import check_probe, global_ns, record

FUSED_MLP_MAX_K = 4096  # x and the accumulator (all of K, float32) live in registers
FOLD_O_MAX_ELEMENTS = 32 * 1024  # o's rows a program holds from before its wait (64 registers a thread at 8 warps)
MAX_THREADS_PER_SM = 2048  # compute capability 8.0 to 9.0


class FusedMlpConfig(NamedTuple):
    """The launch knobs: tiles of ``block_n`` weight rows (half gate, half up), programs an SM."""

    # tools/bench_fused_mlp.py on the H200 (11-30), µs a layer of the 1B: 4 rows, 8 warps, 3 stages,
    # 2 an SM 27.56 / 26.94, at 256 programs (16 tiles each, not 15 or 16) 26.50; 2 rows, 4 warps,
    # 4 an SM (the persistent gemv's tiling) 30.22; the two kernels 28.13 / 27.78. One an SM at 4
    # stages (128 programs of 32 tiles, three tiles in flight each; half the atomics) 25.89–26.30
    # against 26.52–26.90 at 2 an SM, 3 stages; 1 an SM at 3, 5 or 6 stages 28.35, 26.50, 27.10;
    # 8 rows 27.21; 4 warps 27.14 (12th session, variant 85; batch 1 through the engine +0.4 to +1.3 %).
    block_n: int = 4
    num_warps: int = 8
    num_stages: int = 4
    programs_per_sm: int = 1  # at most; fewer where that splits the tiles evenly (even_programs)
    programs: int = 0  # > 0: this many programs in all instead
    # Each program loads its first tile before its prologue (variant 71: 26.27–26.62 against
    # 26.78–26.83 µs a layer in tools/bench_fused_mlp.py; through the engine +0.3 %, within the
    # rows' spread, 11-30). The launch's other ramp knobs lost and are gone: the weights
    # evict-first in L2 (27.25) and the norm inside the loop's first iteration (27.79; −0.9 %
    # through the engine): docs/benchmarks.md, "The fused MLP's launch sweep".
    early_tile: bool = False
    # o's projection folded in, a grid barrier before the MLP (variant 101; see FoldO).
    fold_o: bool = False


class FoldO(NamedTuple):
    """o's projection inside the MLP kernel (``fused_mlp(fold_o=)``; the module docstring)."""

    weight: torch.Tensor  # [K, Q]: o's weight, contiguous, the MLP's dtype
    counter: torch.Tensor  # int64 [1], zero when made: the barrier's tickets (never reset: see _grid_barrier)
    out: torch.Tensor | None = None  # [1, K] of the dtype: o's output, the MLP's x (None: a new one)


@triton.jit(do_not_specialize=["intermediate"])
def _fused_mlp_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    res_out_ptr,
    w_gu_ptr,  # [2 * intermediate, K]: gate rows, then up rows
    w_down_t_ptr,  # [intermediate, K]: down's weight transposed
    out_acc_ptr,  # [K] float32, zero: the sum of every program's part
    zero_ptr,  # [K] float32: set to zero by program 0
    probe_ptr,  # PROBE: the programs' records (triton_probe.py)
    intermediate,
    eps,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    TRIGGER: tl.constexpr,  # let the next kernel launch after the tile loop ...
    TRIGGER_AT_START: tl.constexpr,  # ... or at the program's start
    EARLY_TILE: tl.constexpr,  # the first tile's loads before the prologue
    PDL_WAIT: tl.constexpr,  # launched as a programmatic dependent: wait before reading x
    PROBE: tl.constexpr,  # record where and when each program ran (CUDA only)
    # fold_o: o's rows (attention output, o's weight [K, Q], o's output: the MLP's x) and the barrier
    attn_ptr=None,
    w_o_ptr=None,
    tickets_ptr=None,
    Q: tl.constexpr = 1,
    BLOCK_Q: tl.constexpr = 1,
    O_ROWS: tl.constexpr = 1,  # o's rows a program (a power of two; programs * O_ROWS >= K)
    RUN_O: tl.constexpr = False,  # o's rows into x_ptr
    RUN_MLP: tl.constexpr = True,  # the MLP of x_ptr: after a grid barrier with RUN_O
):
    pid = tl.program_id(0)
    if PROBE:
        started = global_ns()
    if TRIGGER_AT_START:
        tl.extra.cuda.gdc_launch_dependents()
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_K)
    k_mask = cols < K
    pairs: tl.constexpr = BLOCK_N // 2
    n = 2 * intermediate
    acc = tl.zeros((BLOCK_K,), tl.float32)
    start = pid
    if RUN_O:  # o's weights depend on nothing before: loaded before the wait, as o's gemv preloads
        o_rows = pid * O_ROWS + tl.arange(0, O_ROWS)
        q_cols = tl.arange(0, BLOCK_Q)
        w_o = tl.load(w_o_ptr + o_rows.to(tl.int64)[:, None] * Q + q_cols[None, :],
                      mask=(o_rows < K)[:, None] & (q_cols < Q)[None, :], other=0.0)
    elif EARLY_TILE:  # the weights depend on nothing before: their latency under the prologue
        w_first, down_first = _tile_weights(pid, w_gu_ptr, w_down_t_ptr, n, cols, k_mask, K, BLOCK_N)
    if PDL_WAIT:  # x (and the residual, and the sum program 0 zeroes) come from the kernels before
        tl.extra.cuda.gdc_wait()
    if PROBE:
        waited = global_ns()
    if RUN_O:  # o = W_o @ attn, rounded to the dtype as o's gemv stores it: the MLP's x
        attn = tl.load(attn_ptr + q_cols, mask=q_cols < Q, other=0.0).to(tl.float32)
        o = tl.sum(w_o.to(tl.float32) * attn[None, :], axis=1)
        tl.store(x_ptr + o_rows, o.to(x_ptr.dtype.element_ty), mask=o_rows < K)
        if RUN_MLP:
            if EARLY_TILE:  # the first tile's latency under the barrier
                w_first, down_first = _tile_weights(pid, w_gu_ptr, w_down_t_ptr, n, cols, k_mask, K, BLOCK_N)
            _grid_barrier(tickets_ptr, programs)
    if RUN_MLP:
        x, rms = _normed_x(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, zero_ptr, pid, cols, k_mask, eps, K, BLOCK_K,
                           HAS_RESIDUAL, HAS_ZERO, RUN_O)
        if EARLY_TILE:
            acc += _tile_part(w_first, down_first, x, rms, pairs)
            start += programs
        for tile in tl.range(start, tl.cdiv(intermediate, pairs), programs, num_stages=NUM_STAGES):
            w, w_down = _tile_weights(tile, w_gu_ptr, w_down_t_ptr, n, cols, k_mask, K, BLOCK_N)
            acc += _tile_part(w, w_down, x, rms, pairs)
        if TRIGGER and not TRIGGER_AT_START:
            tl.extra.cuda.gdc_launch_dependents()
        tl.atomic_add(out_acc_ptr + cols, acc, mask=k_mask, sem="relaxed")
    if PROBE:
        record(probe_ptr, pid, started, waited)


@triton.jit
def _grid_barrier(tickets_ptr, programs):
    """Wait until every program of this launch has taken its ticket: every thread's stores first
    (a block barrier), one release ticket a program, then acquire loads until the launch's last
    ticket is on the counter. The counter is never reset: each launch adds ``programs`` tickets and
    the launches never overlap (each waits for the kernels before it), so this launch's tickets
    are the ``programs`` after the last multiple of ``programs`` below this program's (int64: no
    wrap in 2^63 tickets)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr, 1, sem="release")
    target = (ticket // programs + 1) * programs
    seen = tl.atomic_add(tickets_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(tickets_ptr, 0, sem="acquire")
    tl.debug_barrier()  # what the acquiring thread saw, for every thread of the program


@triton.jit
def _normed_x(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, zero_ptr, pid, cols, k_mask, eps, K: tl.constexpr,
              BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_ZERO: tl.constexpr, X_FROM_L2: tl.constexpr):
    """The prologue: ``(h * norm_w, rms(h))`` with ``h = x + residual`` rounded to the residual's
    dtype (program 0 stores it as the new residual, and zeroes ``zero``). ``X_FROM_L2``: x was
    written by other programs of this launch (past L1, which is not coherent across SMs)."""
    if X_FROM_L2:
        x = tl.load(x_ptr + cols, mask=k_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        x = tl.load(x_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
    norm_w = tl.load(norm_w_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
        x = x.to(res_out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(res_out_ptr + cols, x.to(res_out_ptr.dtype.element_ty), mask=cols < tl.where(pid == 0, K, 0))
    rms = tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
    if HAS_ZERO:
        tl.store(zero_ptr + cols, tl.zeros((BLOCK_K,), tl.float32), mask=cols < tl.where(pid == 0, K, 0))
    return x * norm_w, rms


@triton.jit
def _tile_weights(tile, w_gu_ptr, w_down_t_ptr, n, cols, k_mask, K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's ``[BLOCK_N, K]`` gate/up rows (gate rows, then the up rows that pair with them)
    and the ``[BLOCK_N / 2, K]`` rows of down's transpose for its activations."""
    pairs: tl.constexpr = BLOCK_N // 2
    rows, _, _ = block_rows(tile, n, 0, 1, BLOCK_N, False, True)
    w = tl.load(w_gu_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=k_mask[None, :], other=0.0)
    act_rows = tile * pairs + tl.arange(0, pairs)
    w_down = tl.load(w_down_t_ptr + act_rows.to(tl.int64)[:, None] * K + cols[None, :], mask=k_mask[None, :],
                     other=0.0)
    return w, w_down


@triton.jit
def _tile_part(w, w_down, x, rms, pairs: tl.constexpr):
    """A tile's part of down's output: ``act @ w_down`` with ``act = silu(gate) * up`` of its rows,
    gate and up rounded to the weights' dtype as the stored projection would be, act too."""
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1) / rms
    y = y.to(w.dtype).to(tl.float32)
    gate, up = tl.split(tl.permute(tl.reshape(y, (2, pairs)), (1, 0)))
    act = (gate / (1.0 + tl.exp(-gate)) * up).to(w.dtype).to(tl.float32)
    return tl.sum(act[:, None] * w_down.to(tl.float32), axis=0)


@functools.lru_cache(maxsize=256)  # per launch of an eager step otherwise: a loop of up to most / 4
def even_programs(tiles: int, most: int) -> int:
    """Programs for ``tiles`` tiles, at most ``most``: the largest count from 3/4 of ``most`` up
    that divides the tiles evenly (every program walks as many; the 1B on the H200: 256 of 264
    for 4,096 tiles), else ``most`` (a last round of tiles on some programs only)."""
    for programs in range(min(most, tiles), max(1, (3 * most) // 4) - 1, -1):
        if tiles % programs == 0:
            return programs
    return min(most, tiles)


LAUNCH_RULES = ("block_n a power of two of at least 2, num_warps a power of two up to 16, num_stages and "
                "programs_per_sm at least 1")


def launchable(config: FusedMlpConfig) -> bool:
    """Whether the kernel can launch with ``config`` at all (LAUNCH_RULES; its fit to an MLP:
    :func:`fused_mlp_fits`)."""
    def power_of_two(n: int) -> bool:
        return n >= 1 and n & (n - 1) == 0
    return (power_of_two(config.block_n) and config.block_n >= 2 and power_of_two(config.num_warps)
            and config.num_warps <= 16 and config.num_stages >= 1 and config.programs_per_sm >= 1
            and config.programs >= 0)


def fused_mlp_fits(hidden: int, intermediate: int, config: FusedMlpConfig = FusedMlpConfig()) -> bool:
    """Whether :func:`fused_mlp` takes an MLP of these sizes with ``config``."""
    return launchable(config) and hidden <= FUSED_MLP_MAX_K and intermediate % (config.block_n // 2) == 0


def down_transposed(down_weight: torch.Tensor) -> torch.Tensor:
    """Down's weight ``[K, intermediate]`` as :func:`fused_mlp` reads it: ``[intermediate, K]``, contiguous."""
    return down_weight.t().contiguous()


def fold_o_rows(hidden: int, programs: int) -> int:
    """o's rows a program with ``fold_o``: the power of two at or above an even share of ``hidden``."""
    return triton.next_power_of_2(triton.cdiv(hidden, programs))


def fold_o_fits(hidden: int, intermediate: int, q_size: int, sms: int,
                config: FusedMlpConfig = FusedMlpConfig()) -> bool:
    """Whether :func:`fused_mlp` takes o's projection (``[hidden, q_size]``) folded in on a device of
    ``sms`` SMs: the MLP fits, and each program's o rows fit in registers (FOLD_O_MAX_ELEMENTS;
    the 1B's 16 rows of 2048 do, the 8B's 32 of 4096 do not)."""
    if not fused_mlp_fits(hidden, intermediate, config):
        return False
    programs = _grid(intermediate, config, sms)
    return fold_o_rows(hidden, programs) * triton.next_power_of_2(q_size) <= FOLD_O_MAX_ELEMENTS


def _grid(intermediate: int, config: FusedMlpConfig, sms: int) -> int:
    tiles = triton.cdiv(intermediate, config.block_n // 2)
    return min(config.programs, tiles) if config.programs else even_programs(tiles, config.programs_per_sm * sms)


def fused_mlp(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    down_weight_t: torch.Tensor,
    out: torch.Tensor,
    *,
    zero: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    trigger: bool = False,
    trigger_at_start: bool = False,
    dependent: bool = False,
    fold_o: FoldO | None = None,
    barrier: bool | None = None,
    probe: torch.Tensor | None = None,
    config: FusedMlpConfig = FusedMlpConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """``down(silu(gate) * up)`` of ``rms_norm(x + residual) * norm_weight`` for one row
    ``x [1, K]`` (see the module docstring), added into ``out`` (``[1, K]`` float32, zero before);
    returns ``(out, x + residual)`` (no residual: x itself is the residual). ``zero``: another
    ``[1, K]`` float32 buffer set to zero. ``dependent``: launched as a programmatic dependent (see
    the module docstring). ``fold_o``: x is the attention's output ``[1, Q]`` and the MLP's x is
    ``fold_o.weight @ x`` (the module docstring); ``barrier``: in one launch with a grid barrier
    (default: on CUDA where every program fits on the SMs at once), else two launches. ``probe``
    (CUDA; diagnostics for tools/bench_fused_mlp.py): where and when each program ran
    (triton_probe.py). Raises ValueError on bad shapes, dtypes or devices."""
    kernel = "fused_mlp"
    two_i, k = gate_up_weight.shape
    intermediate = two_i // 2
    dtype = gate_up_weight.dtype
    if fold_o is not None:
        q = fold_o.weight.shape[-1]
        if fold_o.weight.shape != (k, q) or fold_o.weight.dtype != dtype or not fold_o.weight.is_contiguous():
            raise ValueError(f"{kernel}: fold_o's weight must be a contiguous [{k}, Q] {dtype}, got "
                             f"{tuple(fold_o.weight.shape)} {fold_o.weight.dtype}")
        if x.shape != (1, q) or x.stride(-1) != 1 or x.dtype != dtype:
            raise ValueError(f"{kernel}: with fold_o, x (the attention's output) must be one row [1, {q}] of {dtype} "
                             f"with a unit stride, got {tuple(x.shape)} {x.dtype}")
        if fold_o.counter.shape != (1,) or fold_o.counter.dtype != torch.int64:
            raise ValueError(f"{kernel}: fold_o's counter must be an int64 [1], got {tuple(fold_o.counter.shape)} "
                             f"{fold_o.counter.dtype}")
        if fold_o.out is not None and (fold_o.out.shape != (1, k) or fold_o.out.dtype != dtype
                                       or not fold_o.out.is_contiguous()):
            raise ValueError(f"{kernel}: fold_o's out must be a contiguous [1, {k}] {dtype}, got "
                             f"{tuple(fold_o.out.shape)} {fold_o.out.dtype}")
    elif x.shape != (1, k) or x.stride(-1) != 1 or x.dtype not in (dtype, torch.float32):
        raise ValueError(f"{kernel}: x must be one row [1, {k}] of {dtype} or float32 with a unit stride, got "
                         f"{tuple(x.shape)} {x.dtype}")
    if two_i % 2 or down_weight_t.shape != (intermediate, k) or down_weight_t.dtype != dtype \
            or not down_weight_t.is_contiguous() or not gate_up_weight.is_contiguous():
        raise ValueError(f"{kernel}: gate_up [2I, K] and down transposed [I, K] must be contiguous {dtype}, got "
                         f"{tuple(gate_up_weight.shape)} and {tuple(down_weight_t.shape)} {down_weight_t.dtype}")
    if not fused_mlp_fits(k, intermediate, config):
        raise ValueError(f"{kernel}: hidden {k} (at most {FUSED_MLP_MAX_K}) and intermediate {intermediate} do not "
                         f"fit {config}")
    if fold_o is not None and not fold_o_fits(k, intermediate, x.shape[-1], device_sms(x.device), config):
        raise ValueError(f"{kernel}: o's projection [{k}, {x.shape[-1]}] does not fold in: a program's rows exceed "
                         f"{FOLD_O_MAX_ELEMENTS} elements")
    if residual is not None and (residual.shape != (1, k) or residual.dtype != dtype or residual.stride(-1) != 1):
        raise ValueError(f"{kernel}: residual must be [1, {k}] {dtype} with a unit stride, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        raise ValueError(f"{kernel}: norm_weight must be a contiguous [{k}], got {tuple(norm_weight.shape)}")
    for name, buffer in (("out", out), ("zero", zero)):
        if buffer is not None and (buffer.shape != (1, k) or buffer.dtype != torch.float32
                                   or not buffer.is_contiguous()):
            raise ValueError(f"{kernel}: {name} must be a contiguous [1, {k}] float32, got {tuple(buffer.shape)} "
                             f"{buffer.dtype}")
    if zero is not None and zero.data_ptr() == out.data_ptr():
        raise ValueError(f"{kernel}: zero must be another buffer than out")
    if not eps > 0:
        raise ValueError(f"{kernel}: eps must be > 0, got {eps}")
    tensors = (x, norm_weight, gate_up_weight, down_weight_t, out) + tuple(
        t for t in (residual, zero) if t is not None) + (
        (fold_o.weight, fold_o.counter) + ((fold_o.out,) if fold_o.out is not None else ()) if fold_o else ())
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{kernel}: every tensor must be on one device")
    if (trigger or dependent) and x.device.type != "cuda":
        raise ValueError(f"{kernel}: trigger and dependent (programmatic dependent launch) need a CUDA device, got "
                         f"{x.device}")
    mlp_x = x
    if fold_o is not None:
        mlp_x = fold_o.out if fold_o.out is not None else torch.empty((1, k), dtype=dtype, device=x.device)
    if residual is None:
        residual_out = mlp_x
    elif residual_out is None:
        residual_out = torch.empty((1, k), dtype=dtype, device=x.device)
    grid = (_grid(intermediate, config, device_sms(x.device)),)
    if probe is not None:
        check_probe(probe, grid[0], x.device, kernel)
    args = (mlp_x, residual if residual is not None else mlp_x, norm_weight, residual_out, gate_up_weight,
            down_weight_t, out, zero if zero is not None else out, probe if probe is not None else out, intermediate,
            eps)
    constexprs = dict(
        K=k,
        BLOCK_K=triton.next_power_of_2(k),
        BLOCK_N=config.block_n,
        NUM_STAGES=config.num_stages,
        HAS_RESIDUAL=residual is not None,
        HAS_ZERO=zero is not None,
        TRIGGER=trigger,
        TRIGGER_AT_START=trigger and trigger_at_start,
        EARLY_TILE=config.early_tile,
        PDL_WAIT=dependent,
        PROBE=probe is not None,
        num_warps=config.num_warps,
        # launch_pdl is passed only when on: triton's interpreter knows no such option.
        **({"launch_pdl": True} if dependent else {}),
    )
    if fold_o is None:
        _fused_mlp_kernel[grid](*args, **constexprs)
        return out, residual_out
    q = x.shape[-1]
    fold = dict(attn_ptr=x, w_o_ptr=fold_o.weight, tickets_ptr=fold_o.counter, Q=q,
                BLOCK_Q=triton.next_power_of_2(q), O_ROWS=fold_o_rows(k, grid[0]), RUN_O=True)
    if barrier is None:
        barrier = x.device.type == "cuda" and _all_resident(grid[0], x.device, *args, **fold, **constexprs)
    if barrier:  # the first tile always early: its latency under the barrier
        _fused_mlp_kernel[grid](*args, **fold, **dict(constexprs, EARLY_TILE=True))
        return out, residual_out
    # Two launches: o's rows (the trigger, the probe and the MLP's knobs on the second), then the MLP.
    _fused_mlp_kernel[grid](*args, **fold, **dict(constexprs, TRIGGER=False, TRIGGER_AT_START=False, PROBE=False,
                                                   EARLY_TILE=False), RUN_MLP=False)
    plain = {name: value for name, value in constexprs.items() if name != "launch_pdl"}
    _fused_mlp_kernel[grid](*args, **dict(plain, PDL_WAIT=False))
    return out, residual_out


def _all_resident(programs: int, device: torch.device, *args, **kwargs) -> bool:
    """Whether ``programs`` programs of the kernel launched with these arguments fit on the
    device's SMs at once (a grid barrier needs every program running): :func:`_resident_fits`
    of their signature (tensors by dtype), so that only the first launch of each compiles."""
    def signature(value: object) -> object:
        return ("tensor", value.dtype) if isinstance(value, torch.Tensor) else value
    return _resident_fits(programs, device.index or 0, tuple(signature(a) for a in args),
                          tuple(sorted((name, signature(v)) for name, v in kwargs.items())))


@functools.lru_cache(maxsize=64)
def _resident_fits(programs: int, device_index: int, args: tuple, kwargs: tuple) -> bool:
    """The kernel compiled for this signature (small stand-in tensors of each dtype: the binary
    depends on dtypes and constants, not on sizes), its registers, shared memory and threads
    against the SM's (the compiler decides the registers, and triton versions differ)."""
    device = torch.device("cuda", device_index)

    def stand_in(value: object) -> object:
        if isinstance(value, tuple) and len(value) == 2 and value[0] == "tensor":
            return torch.empty(64, dtype=value[1], device=device)
        return value
    named = {name: stand_in(value) for name, value in kwargs}
    compiled = _fused_mlp_kernel.warmup(*(stand_in(a) for a in args), grid=(programs,), **named)
    compiled._init_handles()  # n_regs is read from the loaded binary
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    warps = named["num_warps"]
    regs = -(-max(1, compiled.n_regs) * 32 // 256) * 256 * warps  # allocated per warp, 256 at a time
    shared = compiled.metadata.shared
    resident = min(props["max_num_regs"] // regs, MAX_THREADS_PER_SM // (32 * warps),
                   props["max_shared_mem"] // (shared + 1024) if shared else MAX_THREADS_PER_SM)
    return resident * props["multiprocessor_count"] >= programs
