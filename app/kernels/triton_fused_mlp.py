"""A batch-1 MLP in one persistent kernel: ``down(silu(gate) * up)`` of ``rms_norm(x + residual)``.

Why: the 1B's decode step runs gate_up (67 MB) and down (34 MB) as two kernels, 18.4 and 9.8 us a
layer against 15.6 and 7.8 of bytes at the copy bandwidth (docs/gpu_notes.md, lead 1 (d)): each
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
LlamaForCausalLM._store_down_transposed), so the rows a tile needs are contiguous. The result
is a float32 sum in ``out``, which must be zero before the launch: the next kernel reads it as
its x (gemv_add_rms_norm takes a float32 x over a residual of the model's dtype). ``zero``
(another ``[K]`` float32 buffer, if given) is set to zero by program 0, so that buffers taken
in turn by consecutive layers are each zero again before their next use: the model has each
layer zero its predecessor's sum, which this layer's own qkv kernel has read by then.

Programs: at most ``programs_per_sm`` an SM, and of those the most that walk the same number of
tiles (:func:`even_programs`): a last round of tiles on half the programs cost 0.4 us a layer.

Rounding follows the two-kernel path's: gate and up rounded to the dtype, silu(gate) * up
rounded to it; only the order of down's float32 sum differs (and it is not rounded to the dtype
before the next layer's residual add), so results match the unfused path within float32
rounding, not bit for bit, and differ from run to run in the last bits (the atomics' order).

``trigger`` (CUDA): let the kernel after this one launch as a programmatic dependent once this
one's tile loop is done (as the persistent gemv's late trigger). Launched plainly.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from app.kernels.triton_gemv import RotaryStore, _device_sms
from app.kernels.triton_gemv_epilogues import block_rows

FUSED_MLP_MAX_K = 4096  # x and the accumulator (all of K, float32) live in registers
SMEM_PER_SM = 228 * 1024  # compute capability 9.0 (the H200): what caps a dependent's programs an SM
MAX_STAGES = 8
MAX_THREADS_PER_SM = 2048  # compute capability 8.0 to 9.0


class FusedMlpConfig(NamedTuple):
    """The launch knobs: tiles of ``block_n`` weight rows (half gate, half up), programs an SM."""

    # tools/bench_fused_mlp.py on the H200 (11-30), µs a layer of the 1B: 4 rows, 8 warps, 3 stages,
    # 2 an SM 27.56 / 26.94, at 256 programs (16 tiles each, not 15 or 16) 26.50; 2 rows, 4 warps,
    # 4 an SM (the persistent gemv's tiling) 30.22; the two kernels 28.13 / 27.78.
    block_n: int = 4
    num_warps: int = 8
    num_stages: int = 3
    programs_per_sm: int = 2  # at most; fewer where that splits the tiles evenly (even_programs)
    programs: int = 0  # > 0: this many programs in all instead
    # Each program loads its first tile before its prologue (variant 71; as a dependent always).
    early_tile: bool = False
    # With next_qkv: each program loads its qkv rows before the MLP, not after it (variant 73).
    qkv_early: bool = False


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
    intermediate,
    eps,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    TRIGGER: tl.constexpr,
    EARLY_TILE: tl.constexpr,  # the first tile's loads before the prologue (and the PDL wait)
    PDL_WAIT: tl.constexpr,  # launched as a programmatic dependent: wait for the kernel before
    # The next layer's qkv projection (variant 73, see NextQkv): its weights, output, norm and
    # new residual, the grid barrier's counter and the one program 0 zeroes, the rotary tables,
    # the token's position and slot, the layer's caches.
    qkv_w_ptr=None,
    qkv_out_ptr=None,
    qkv_norm_w_ptr=None,
    qkv_res_out_ptr=None,
    counter_ptr=None,
    zero_counter_ptr=None,
    cos_ptr=None,
    sin_ptr=None,
    pos_ptr=None,
    loc_ptr=None,
    k_cache_ptr=None,
    v_cache_ptr=None,
    stride_cos=0,
    stride_cache_slot=0,
    stride_cache_head=0,
    qkv_blocks=0,
    rotary_blocks=0,
    qkv_eps=1.0,
    RUN_MLP: tl.constexpr = True,  # the MLP (the sum into out_acc_ptr)
    RUN_QKV: tl.constexpr = False,  # the next qkv: after a grid barrier with RUN_MLP, else after a launch of it
    QKV_EARLY: tl.constexpr = False,  # the qkv rows loaded before the MLP, not after it
    QKV_TILES: tl.constexpr = 1,  # qkv blocks a program (a power of two, >= cdiv(qkv_blocks, programs))
    QKV_BLOCK_N: tl.constexpr = 4,  # rows a qkv block: QKV_BLOCK_N / 2 rotary pairs of one head
    HALF: tl.constexpr = 32,  # head_dim / 2
    NUM_Q_HEADS: tl.constexpr = 32,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_K)
    k_mask = cols < K
    pairs: tl.constexpr = BLOCK_N // 2
    n = 2 * intermediate
    if RUN_QKV:
        # This program's qkv blocks; their weights depend on nothing: with QKV_EARLY loaded first,
        # in the MLP's ramp (held in registers through its loop), else after its loop, before the barrier.
        blocks = pid + programs * tl.arange(0, QKV_TILES)
        qkv_rows = _qkv_block_rows(blocks, rotary_blocks, HALF, QKV_BLOCK_N)
        block_ok = blocks < qkv_blocks
        if QKV_EARLY:
            w_qkv = tl.load(qkv_w_ptr + qkv_rows.to(tl.int64)[:, :, None] * K + cols[None, None, :],
                            mask=block_ok[:, None, None] & k_mask[None, None, :], other=0.0)
    if RUN_MLP:
        if EARLY_TILE:  # the weights depend on nothing before: their latency under the wait and the prologue
            w_first, down_first = _tile_weights(pid, w_gu_ptr, w_down_t_ptr, n, cols, k_mask, K, BLOCK_N)
        if PDL_WAIT:
            tl.extra.cuda.gdc_wait()
        h = tl.load(x_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
        norm_w = tl.load(norm_w_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:  # h = x + residual, rounded to the residual's dtype: the new residual (program 0 stores it)
            h += tl.load(res_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
            h = h.to(res_out_ptr.dtype.element_ty).to(tl.float32)
            tl.store(res_out_ptr + cols, h.to(res_out_ptr.dtype.element_ty), mask=cols < tl.where(pid == 0, K, 0))
        rms = tl.sqrt(tl.sum(h * h, axis=0) / K + eps)
        x = h * norm_w
        if HAS_ZERO:
            tl.store(zero_ptr + cols, tl.zeros((BLOCK_K,), tl.float32), mask=cols < tl.where(pid == 0, K, 0))
        acc = tl.zeros((BLOCK_K,), tl.float32)
        start = pid
        if EARLY_TILE:
            acc += _tile_part(w_first, down_first, x, rms, pairs)
            start += programs
        for tile in tl.range(start, tl.cdiv(intermediate, pairs), programs, num_stages=NUM_STAGES):
            w, w_down = _tile_weights(tile, w_gu_ptr, w_down_t_ptr, n, cols, k_mask, K, BLOCK_N)
            acc += _tile_part(w, w_down, x, rms, pairs)
        if TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    if RUN_QKV:
        tl.store(zero_counter_ptr, 0, mask=pid == 0)  # the barrier's counter of the layer before, for its next use
        if not QKV_EARLY:
            w_qkv = tl.load(qkv_w_ptr + qkv_rows.to(tl.int64)[:, :, None] * K + cols[None, None, :],
                            mask=block_ok[:, None, None] & k_mask[None, None, :], other=0.0)
        slot = tl.load(loc_ptr).to(tl.int64)
        position = tl.load(pos_ptr).to(tl.int64)
        cos, sin = _qkv_rotary_tables(blocks, block_ok, rotary_blocks, position, cos_ptr, sin_ptr, stride_cos, HALF,
                                      QKV_BLOCK_N)
        if RUN_MLP:
            tl.atomic_add(out_acc_ptr + cols, acc, mask=k_mask, sem="relaxed")
            # Every program's part is in the sum once every program has passed its ticket.
            tl.debug_barrier()
            tl.atomic_add(counter_ptr, 1, sem="release")
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
            while seen < programs:
                seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
            tl.debug_barrier()
        else:  # after a launch of the MLP alone: its new residual is in memory
            h = tl.load(res_out_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
        # The next layer's norm prologue, as gemv_add_rms_norm's over a float32 x: h2 = sum + h,
        # rounded to the residual's dtype, is the next residual (program 0 stores it).
        h2 = tl.load(out_acc_ptr + cols, mask=k_mask, other=0.0, cache_modifier=".cg") + h
        h2 = h2.to(qkv_res_out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(qkv_res_out_ptr + cols, h2.to(qkv_res_out_ptr.dtype.element_ty), mask=cols < tl.where(pid == 0, K, 0))
        rms2 = tl.sqrt(tl.sum(h2 * h2, axis=0) / K + qkv_eps)
        x2 = h2 * tl.load(qkv_norm_w_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
        y = tl.sum(w_qkv.to(tl.float32) * x2[None, None, :], axis=2) / rms2
        _qkv_rotate_and_store(y, blocks, qkv_rows, block_ok, rotary_blocks, qkv_out_ptr, slot, cos, sin, k_cache_ptr,
                              v_cache_ptr, stride_cache_slot, stride_cache_head, QKV_TILES, HALF, NUM_Q_HEADS,
                              QKV_BLOCK_N)
    else:
        tl.atomic_add(out_acc_ptr + cols, acc, mask=k_mask, sem="relaxed")


@triton.jit
def _qkv_block_rows(blocks, rotary_blocks, HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[tiles, BLOCK_N]``: the qkv weight rows of each block, as triton_gemv_epilogues.block_rows
    maps one (ROTARY): a q or k block's BLOCK_N / 2 rotary pairs of one head, rows j.. then
    j + HALF.., the v blocks after them BLOCK_N rows in order."""
    idx = tl.arange(0, BLOCK_N)
    pairs: tl.constexpr = BLOCK_N // 2
    head = blocks // (HALF // pairs)
    first = (blocks % (HALF // pairs)) * pairs
    rotary_rows = (head * (2 * HALF) + first)[:, None] + (idx % pairs + (idx // pairs) * HALF)[None, :]
    return tl.where((blocks < rotary_blocks)[:, None], rotary_rows, blocks[:, None] * BLOCK_N + idx[None, :])


@triton.jit
def _qkv_rotary_tables(blocks, block_ok, rotary_blocks, position, cos_ptr, sin_ptr, stride_cos, HALF: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """``[tiles, BLOCK_N / 2]`` cos and sin of each q or k block's dims at ``position`` (zero for v blocks)."""
    pairs: tl.constexpr = BLOCK_N // 2
    rotary = block_ok & (blocks < rotary_blocks)
    dims = ((blocks % (HALF // pairs)) * pairs)[:, None] + tl.arange(0, pairs)[None, :]
    cos = tl.load(cos_ptr + position * stride_cos + dims, mask=rotary[:, None], other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_cos + dims, mask=rotary[:, None], other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _qkv_rotate_and_store(y, blocks, rows, block_ok, rotary_blocks, out_ptr, slot, cos, sin, k_cache_ptr,
                          v_cache_ptr, stride_cache_slot, stride_cache_head, TILES: tl.constexpr, HALF: tl.constexpr,
                          NUM_Q_HEADS: tl.constexpr, BLOCK_N: tl.constexpr):
    """triton_gemv_epilogues.rotate_and_store over ``[tiles, BLOCK_N]`` sums ``y``, with masks
    instead of branches: q rows rotated into ``out``, k rows into the K cache and v rows into the
    V cache at ``slot``; ``cos`` and ``sin`` from :func:`_qkv_rotary_tables`."""
    pairs: tl.constexpr = BLOCK_N // 2
    rotary = block_ok & (blocks < rotary_blocks)
    head = blocks // (HALF // pairs)
    dims = ((blocks % (HALF // pairs)) * pairs)[:, None] + tl.arange(0, pairs)[None, :]
    x1, x2 = tl.split(tl.permute(tl.reshape(y, (TILES, 2, pairs)), (0, 2, 1)))
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    is_q = (rotary & (head < NUM_Q_HEADS))[:, None]
    q_dst = out_ptr + (head * (2 * HALF))[:, None] + dims
    tl.store(q_dst, o1.to(out_ptr.dtype.element_ty), mask=is_q)
    tl.store(q_dst + HALF, o2.to(out_ptr.dtype.element_ty), mask=is_q)
    is_k = (rotary & (head >= NUM_Q_HEADS))[:, None]
    k_dst = k_cache_ptr + slot * stride_cache_slot + ((head - NUM_Q_HEADS) * stride_cache_head)[:, None] + dims
    tl.store(k_dst, o1.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    tl.store(k_dst + HALF, o2.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    v_rows = rows - rotary_blocks * BLOCK_N  # within v: the q and k rows come first
    v_dst = v_cache_ptr + slot * stride_cache_slot + (v_rows // (2 * HALF)) * stride_cache_head + v_rows % (2 * HALF)
    tl.store(v_dst, y.to(v_cache_ptr.dtype.element_ty), mask=(block_ok & (blocks >= rotary_blocks))[:, None])


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


def fused_mlp_fits(hidden: int, intermediate: int, config: FusedMlpConfig = FusedMlpConfig()) -> bool:
    """Whether :func:`fused_mlp` takes an MLP of these sizes with ``config``."""
    pairs = config.block_n // 2
    return 2 <= config.block_n and config.block_n & (config.block_n - 1) == 0 and hidden <= FUSED_MLP_MAX_K \
        and intermediate % pairs == 0


@functools.lru_cache(maxsize=256)
def dependent_stages(config: FusedMlpConfig, k: int, element_size: int) -> int:
    """Pipeline stages for a launch as a programmatic dependent: at least the config's, and enough
    that the staged tiles' shared memory lets no more than ``programs_per_sm`` programs onto an SM
    (the pipeline holds ``stages - 1`` tiles). Launched early, a dependent's programs land on the
    SMs its predecessor frees first; capped so, every SM still gets its share (variant 62's cap,
    here at 8-warp programs). The 1B on the H200: 5 stages (98 KB a program, 2 an SM)."""
    tile_bytes = (config.block_n + config.block_n // 2) * k * element_size
    stages = config.num_stages
    while stages < MAX_STAGES and (stages - 1) * tile_bytes * (config.programs_per_sm + 1) <= SMEM_PER_SM:
        stages += 1
    return stages


class NextQkv(NamedTuple):
    """The next layer's qkv projection, folded into :func:`fused_mlp` (variant 73): after the
    MLP, a grid barrier (every program's part is in the sum), then each program computes the
    next layer's norm prologue (``h2 = sum + h``, rounded: the next residual) and its share of the
    qkv rows, loaded before the barrier, with the rotary epilogue of gemv_add_rms_norm's
    ``rotary=`` (q into ``out``'s q columns, k and v into the caches)."""

    weight: torch.Tensor  # [(Hq + 2 Hk) * head_dim, K], the model's dtype
    out: torch.Tensor  # [1, (Hq + 2 Hk) * head_dim]: q rotated into its columns
    norm_weight: torch.Tensor  # the next layer's input norm [K]
    eps: float
    residual_out: torch.Tensor  # [1, K]: the next residual, sum + h
    rotary: RotaryStore
    counter: torch.Tensor  # int32 [1], zero before the launch: the grid barrier's tickets
    zero_counter: torch.Tensor  # int32 [1], another: set to zero by program 0 (the counter of the layer before)


QKV_MAX_K = 2048  # the program's qkv rows live in registers beside the MLP's: [tiles, 4, K] of them
QKV_BLOCK_N = 4  # qkv rows a block: two rotary pairs of one head (or four v rows)
QKV_MAX_TILES = 4


def next_qkv_fits(num_q_heads: int, num_kv_heads: int, head_dim: int, hidden: int, intermediate: int,
                  num_sms: int, config: FusedMlpConfig = FusedMlpConfig()) -> bool:
    """Whether :func:`fused_mlp` can fold in the next layer's qkv projection of these sizes: K
    small enough that the qkv rows fit in registers beside the MLP's, at most QKV_MAX_TILES blocks
    a program, and blocks of whole rotary pairs of one head."""
    pairs = QKV_BLOCK_N // 2
    half = head_dim // 2
    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    if not (fused_mlp_fits(hidden, intermediate, config) and hidden <= QKV_MAX_K and head_dim % 2 == 0
            and half % pairs == 0 and (num_kv_heads * head_dim) % QKV_BLOCK_N == 0):
        return False
    programs = _programs(intermediate, config, num_sms)
    return triton.cdiv(n // QKV_BLOCK_N, programs) <= QKV_MAX_TILES


def _programs(intermediate: int, config: FusedMlpConfig, num_sms: int) -> int:
    tiles = triton.cdiv(intermediate, config.block_n // 2)
    return min(config.programs, tiles) if config.programs else even_programs(tiles, config.programs_per_sm * num_sms)


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
    dependent: bool = False,
    next_qkv: NextQkv | None = None,
    barrier: bool | None = None,
    config: FusedMlpConfig = FusedMlpConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """``down(silu(gate) * up)`` of ``rms_norm(x + residual) * norm_weight`` for one row
    ``x [1, K]`` (see the module docstring), added into ``out`` (``[1, K]`` float32, zero before);
    returns ``(out, x + residual)`` (no residual: x itself is the residual). ``zero``: another
    ``[1, K]`` float32 buffer set to zero. Raises ValueError on bad shapes, dtypes or devices.

    ``dependent`` (CUDA, variant 71): launch as a programmatic dependent of the kernel before it:
    each program loads its first tile, waits for that kernel, then runs its prologue, so that the
    launch and the first loads overlap the kernel before; the pipeline is deepened until shared
    memory caps the programs at ``programs_per_sm`` an SM (:func:`dependent_stages`).

    ``next_qkv`` (variant 73): the next layer's qkv projection too (see NextQkv); returns
    ``(next_qkv.out, next_qkv.residual_out)`` then. ``barrier``: in one launch with a grid barrier
    (the default on CUDA: every program must be resident at once, which the configs that
    :func:`next_qkv_fits` takes are at two an SM), else two launches of the kernel, the MLP's then
    the qkv's (the interpreter runs programs one after another: a barrier would never open)."""
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
    grid = (_programs(intermediate, config, _device_sms(x.device)),)
    args = (x, residual if residual is not None else x, norm_weight, residual_out, gate_up_weight, down_weight_t,
            out, zero if zero is not None else out, intermediate, eps)
    constexprs = dict(
        K=k,
        BLOCK_K=triton.next_power_of_2(k),
        BLOCK_N=config.block_n,
        NUM_STAGES=dependent_stages(config, k, gate_up_weight.element_size()) if dependent else config.num_stages,
        HAS_RESIDUAL=residual is not None,
        HAS_ZERO=zero is not None,
        TRIGGER=trigger,
        EARLY_TILE=config.early_tile or dependent,
        PDL_WAIT=dependent,
        num_warps=config.num_warps,
        # launch_pdl only when on: triton's interpreter knows no such option.
        **({"launch_pdl": True} if dependent else {}),
    )
    if next_qkv is None:
        _fused_mlp_kernel[grid](*args, **constexprs)
        return out, residual_out
    qkv = _next_qkv_args(next_qkv, k, dtype, x.device, residual is not None, grid[0], config)
    if barrier is None:
        barrier = x.device.type == "cuda"
    if barrier and not _all_resident(grid[0], x.device, *args, **qkv, **constexprs, RUN_QKV=True):
        barrier = False  # some programs would wait for SM room that the spinning ones never free
    if barrier:
        _fused_mlp_kernel[grid](*args, **qkv, **constexprs, RUN_QKV=True)
    else:
        _fused_mlp_kernel[grid](*args, **qkv, **constexprs)
        _fused_mlp_kernel[grid](*args, **qkv, **dict(constexprs, TRIGGER=False, PDL_WAIT=False, EARLY_TILE=False),
                                RUN_MLP=False, RUN_QKV=True)
    return next_qkv.out, next_qkv.residual_out


def _all_resident(programs: int, device: torch.device, *args, **kwargs) -> bool:
    """Whether ``programs`` programs of the kernel so compiled fit on the device's SMs at once,
    by its registers, shared memory and threads (a grid barrier needs every program running):
    the compiler decides the registers, and triton versions differ (129 registers a thread
    would halve the programs an SM at 8 warps)."""
    compiled = _fused_mlp_kernel.warmup(*args, grid=(programs,), **kwargs)
    compiled._init_handles()  # n_regs is read from the loaded binary
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    warps = kwargs["num_warps"]
    regs = -(-max(1, compiled.n_regs) * 32 // 256) * 256 * warps  # allocated per warp, 256 at a time
    shared = compiled.metadata.shared
    resident = min(props["max_num_regs"] // regs, MAX_THREADS_PER_SM // (32 * warps),
                   props["max_shared_mem"] // (shared + 1024) if shared else MAX_THREADS_PER_SM)
    return resident * props["multiprocessor_count"] >= programs


def _next_qkv_args(next_qkv: NextQkv, k: int, dtype: torch.dtype, device: torch.device, has_residual: bool,
                   programs: int, config: FusedMlpConfig) -> dict:
    """The kernel's arguments for ``next_qkv``; ValueError where it does not fit."""
    kernel = "fused_mlp"
    weight, rot = next_qkv.weight, next_qkv.rotary
    n = weight.shape[0]
    head_dim = rot.k_cache.shape[-1]
    num_kv_heads = rot.k_cache.shape[-2]
    half = head_dim // 2
    if not has_residual:
        raise ValueError(f"{kernel}: next_qkv needs a residual (the layers after the first)")
    if weight.shape != ((rot.num_q_heads + 2 * num_kv_heads) * head_dim, k) or weight.dtype != dtype \
            or not weight.is_contiguous():
        raise ValueError(f"{kernel}: next_qkv's weight must be a contiguous [(Hq + 2 Hk) * head_dim, {k}] {dtype}, "
                         f"got {tuple(weight.shape)} {weight.dtype}")
    if next_qkv.out.shape != (1, n) or next_qkv.out.dtype != dtype or not next_qkv.out.is_contiguous():
        raise ValueError(f"{kernel}: next_qkv's out must be a contiguous [1, {n}] {dtype}, got "
                         f"{tuple(next_qkv.out.shape)} {next_qkv.out.dtype}")
    if next_qkv.residual_out.shape != (1, k) or next_qkv.residual_out.dtype != dtype:
        raise ValueError(f"{kernel}: next_qkv's residual_out must be [1, {k}] {dtype}")
    for name, counter in (("counter", next_qkv.counter), ("zero_counter", next_qkv.zero_counter)):
        if counter.numel() != 1 or counter.dtype != torch.int32:
            raise ValueError(f"{kernel}: next_qkv's {name} must be one int32")
    if next_qkv.counter.data_ptr() == next_qkv.zero_counter.data_ptr():
        raise ValueError(f"{kernel}: next_qkv's zero_counter must be another than its counter")
    blocks = n // QKV_BLOCK_N
    tiles = triton.cdiv(blocks, programs)
    if k > QKV_MAX_K or half % (QKV_BLOCK_N // 2) or (num_kv_heads * head_dim) % QKV_BLOCK_N \
            or tiles > QKV_MAX_TILES:
        raise ValueError(f"{kernel}: next_qkv of {n} rows over hidden {k} does not fit (next_qkv_fits)")
    return dict(
        qkv_w_ptr=weight, qkv_out_ptr=next_qkv.out, qkv_norm_w_ptr=next_qkv.norm_weight,
        qkv_res_out_ptr=next_qkv.residual_out, counter_ptr=next_qkv.counter, zero_counter_ptr=next_qkv.zero_counter,
        cos_ptr=rot.cos, sin_ptr=rot.sin, pos_ptr=rot.positions, loc_ptr=rot.loc, k_cache_ptr=rot.k_cache,
        v_cache_ptr=rot.v_cache, stride_cos=rot.cos.stride(0), stride_cache_slot=rot.k_cache.stride(0),
        stride_cache_head=rot.k_cache.stride(1), qkv_blocks=blocks,
        rotary_blocks=(rot.num_q_heads + num_kv_heads) * half // (QKV_BLOCK_N // 2), qkv_eps=next_qkv.eps,
        QKV_TILES=triton.next_power_of_2(tiles), QKV_EARLY=config.qkv_early, QKV_BLOCK_N=QKV_BLOCK_N, HALF=half, NUM_Q_HEADS=rot.num_q_heads,
    )
