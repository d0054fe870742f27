"""A batch-1 MLP in one persistent kernel: ``down(silu(gate) * up)`` of ``rms_norm(x + residual)``.

Why: the 1B's decode step runs gate_up (67 MB) and down (34 MB) as two kernels, each slower than
its bytes at the copy bandwidth (lab/notes/gpu_notes.md): each kernel pays its own ramp and
tail, and down's programs start only once every SiLU output exists, because each of down's rows
needs all of them. Split by the intermediate index instead, the down
projection needs nothing but the activations a program has just made:

    program p:  x = rms_norm(x + residual) * norm_weight      once, all of K (as triton_gemv_rows)
                acc[K] = 0                                    float32, in registers
                for tile in p, p + P, ...:                    (pipelined: num_stages tiles in flight)
                    g, u = W_gate_up[rows(tile), :] @ x       the tile's gate rows and their up rows
                    a = silu(g) * u                           BLOCK_N / 2 activations
                    acc += a @ W_down_t[tile's activations, :]   rows of down's transpose: contiguous
                atomic_add(out[K], acc)                       one float32 add per element a program

``W_down_t`` is down's weight transposed (``[intermediate, K]``: the model stores it so, see
app/engine/models/fused_decode.py), so the rows a tile needs are contiguous. The result
is a float32 sum in ``out``, which must be zero before the launch: the next kernel reads it as
its x (gemv_add_rms_norm takes a float32 x over a residual of the model's dtype). ``zero``
(another ``[K]`` float32 buffer, if given) is set to zero by program 0, so that buffers taken
in turn by consecutive layers are each zero again before their next use: the model has each
layer zero its predecessor's sum, which this layer's own qkv kernel has read by then.

Programs: at most ``programs_per_sm`` an SM (one, with three tiles in flight: twice as many
programs with two each ran slower, their atomics twice as many), and of those the most that walk
the same number of tiles (:func:`even_programs`): a last round of tiles on half the programs is
a ramp's worth of idle SMs.

Rounding follows the two-kernel path's: gate and up rounded to the dtype, silu(gate) * up
rounded to it; only the order of down's float32 sum differs (and it is not rounded to the dtype
before the next layer's residual add), so results match the unfused path within float32
rounding, not bit for bit, and differ from run to run in the last bits (the atomics' order).

``trigger`` (CUDA): let the kernel after this one launch as a programmatic dependent once this
one's tile loop is done (as the persistent gemv's late trigger), or with ``trigger_at_start`` at
each program's start, so that the next kernel's programs are resident beside this one's (one an
SM, registers to spare) and waiting when it ends, instead of launching ~0.7 us after its last
program (lab/tools/bench_fused_mlp.py --before-qkv --probe). Launched plainly by the model:
as o's programmatic dependent (``dependent``: each program waits, ``griddepcontrol.wait``,
before reading x; with ``early_tile`` after its first tile's loads) the kernel streamed much
slower on the H200 (lab/notes/gpu_notes.md); ``dependent`` stays for
lab/tools/bench_fused_mlp.py's ``--after-o``, which looks for why.
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


class FusedMlpConfig(NamedTuple):
    """The launch knobs: tiles of ``block_n`` weight rows (half gate, half up), programs an SM."""

    # The fastest launch of lab/tools/bench_fused_mlp.py's sweep on the H200 for the 1B: one program
    # an SM with three tiles in flight (half the atomics of two an SM), 4 rows, 8 warps (the
    # sweep's figures: lab/notes/gpu_notes.md).
    block_n: int = 4
    num_warps: int = 8
    num_stages: int = 4
    programs_per_sm: int = 1  # at most; fewer where that splits the tiles evenly (even_programs)
    programs: int = 0  # > 0: this many programs in all instead
    # Each program loads its first tile before its prologue: faster in the kernel bench, within
    # the noise through the engine, so off by default (lab/notes/gpu_notes.md).
    early_tile: bool = False


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
    if EARLY_TILE:  # the weights depend on nothing before: their latency under the prologue
        w_first, down_first = _tile_weights(pid, w_gu_ptr, w_down_t_ptr, n, cols, k_mask, K, BLOCK_N)
    if PDL_WAIT:  # x (and the residual, and the sum program 0 zeroes) come from the kernels before
        tl.extra.cuda.gdc_wait()
    if PROBE:
        waited = global_ns()
    x, rms = _normed_x(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, zero_ptr, pid, cols, k_mask, eps, K, BLOCK_K,
                       HAS_RESIDUAL, HAS_ZERO)
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
def _normed_x(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, zero_ptr, pid, cols, k_mask, eps, K: tl.constexpr,
              BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_ZERO: tl.constexpr):
    """The prologue: ``(h * norm_w, rms(h))`` with ``h = x + residual`` rounded to the residual's
    dtype (program 0 stores it as the new residual, and zeroes ``zero``)."""
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
    probe: torch.Tensor | None = None,
    config: FusedMlpConfig = FusedMlpConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """``down(silu(gate) * up)`` of ``rms_norm(x + residual) * norm_weight`` for one row
    ``x [1, K]`` (see the module docstring), added into ``out`` (``[1, K]`` float32, zero before);
    returns ``(out, x + residual)`` (no residual: x itself is the residual). ``zero``: another
    ``[1, K]`` float32 buffer set to zero. ``dependent``: launched as a programmatic dependent (see
    the module docstring). ``probe`` (CUDA; diagnostics for lab/tools/bench_fused_mlp.py): where and
    when each program ran (triton_probe.py). Raises ValueError on bad shapes, dtypes or devices."""
    kernel = "fused_mlp"
    two_i, k = gate_up_weight.shape
    intermediate = two_i // 2
    dtype = gate_up_weight.dtype
    if x.shape != (1, k) or x.stride(-1) != 1 or x.dtype not in (dtype, torch.float32):
        raise ValueError(f"{kernel}: x must be one row [1, {k}] of {dtype} or float32 with a unit stride, got "
                         f"{tuple(x.shape)} {x.dtype}")
    if two_i % 2 or down_weight_t.shape != (intermediate, k) or down_weight_t.dtype != dtype \
            or not down_weight_t.is_contiguous() or not gate_up_weight.is_contiguous():
        raise ValueError(f"{kernel}: gate_up [2I, K] and down transposed [I, K] must be contiguous {dtype}, got "
                         f"{tuple(gate_up_weight.shape)} and {tuple(down_weight_t.shape)} {down_weight_t.dtype}")
    if not fused_mlp_fits(k, intermediate, config):
        raise ValueError(f"{kernel}: hidden {k} (at most {FUSED_MLP_MAX_K}) and intermediate {intermediate} do not "
                         f"fit {config}")
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
        t for t in (residual, zero) if t is not None)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{kernel}: every tensor must be on one device")
    if (trigger or dependent) and x.device.type != "cuda":
        raise ValueError(f"{kernel}: trigger and dependent (programmatic dependent launch) need a CUDA device, got "
                         f"{x.device}")
    if residual is None:
        residual_out = x
    elif residual_out is None:
        residual_out = torch.empty((1, k), dtype=dtype, device=x.device)
    pairs = config.block_n // 2
    tiles = triton.cdiv(intermediate, pairs)
    grid = (min(config.programs, tiles) if config.programs else
            even_programs(tiles, config.programs_per_sm * device_sms(x.device)),)
    if probe is not None:
        check_probe(probe, grid[0], x.device, kernel)
    _fused_mlp_kernel[grid](
        x, residual if residual is not None else x, norm_weight, residual_out, gate_up_weight, down_weight_t,
        out, zero if zero is not None else out, probe if probe is not None else out, intermediate, eps,
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
    return out, residual_out
