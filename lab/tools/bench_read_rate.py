"""How fast can a kernel read HBM on this GPU, and which way of loading gets there (GPU).

    python lab/tools/bench_read_rate.py [--mb 100.7] [--layers 16] [--repeats 20] [--only SUBSTRING] [--json PATH]

Why: batch 1 decode is a stream of weights (2.47 GB a step for the 1B), and its roofline divides
those bytes by the copy bandwidth (4.23 TB/s, read + write). Our streaming kernels (the fused
MLP, the lm_head) read at ~4.3 TB/s at their heart; if plain reads can go faster with another
load pattern (more bytes in flight, bigger tiles, TMA, a cache hint), every weight kernel gains
in proportion, where the kernel-boundary work of lab/notes/gpu_notes.md's lead 1 found nothing left.

Each row streams ``--layers`` buffers of ``--mb`` MB (the 1B's MLP weights a layer by default;
16 copies, past the 60 MB L2) in one CUDA graph and reports µs a buffer and TB/s:
- torch: a copy (its read + written bytes), ``torch.mv`` (cuBLAS' gemv) and ``sum``;
- a persistent triton kernel summing 1-D tiles (``pid, pid + P, ...`` or one contiguous chunk a
  program), by programs an SM, warps, pipeline stages, tile size, cache modifier and L2 policy;
- the same over 2-D TMA tiles (``TensorDescriptor``), by box height and stages;
- at a size of three equal matrices (the default): the fused MLP kernel's own loads
  (app/kernels/triton_fused_mlp.py: 2 gate, 2 up and 2 down-transposed rows a tile), then with its
  per-tile dot products, its norm prologue and its float32 atomics added one by one (and the
  atomics rotated, split over 2-8 sums, or four floats an atomic), each atomic variant checked
  against the plain one: where the kernel's time goes beyond its bytes; at the ninth session's
  launch (two programs an SM, 3 stages) and at variant 85's (one an SM, 4 stages); and with a
  warp on each pair (``_mlp_warp_rows_kernel``, variant 82).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv import time_graph  # noqa: E402  (lab/tools/, this script's folder, is on sys.path)

ROW = 2048  # elements a row of the 2-D view (the 1B's hidden size)


@triton.jit
def _read_kernel(ptr, tiles, sums_ptr, TILE: tl.constexpr, NUM_STAGES: tl.constexpr, CHUNKED: tl.constexpr,
                 CACHE: tl.constexpr, EVICT: tl.constexpr):
    """Sum this program's tiles of ``ptr`` into ``sums[pid]``: tiles ``pid, pid + P, ...``, or
    (``CHUNKED``) one contiguous run of ``ceil(tiles / P)``."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offsets = tl.arange(0, TILE)
    acc = tl.zeros((TILE,), dtype=tl.float32)
    if CHUNKED:
        per = tl.cdiv(tiles, programs)
        for tile in tl.range(pid * per, tl.minimum(pid * per + per, tiles), num_stages=NUM_STAGES):
            acc += tl.load(ptr + tile * TILE + offsets, cache_modifier=CACHE,
                           eviction_policy=EVICT).to(tl.float32)
    else:
        for tile in tl.range(pid, tiles, programs, num_stages=NUM_STAGES):
            acc += tl.load(ptr + tile * TILE + offsets, cache_modifier=CACHE,
                           eviction_policy=EVICT).to(tl.float32)
    tl.store(sums_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _read_tma_kernel(desc, rows, sums_ptr, BOX_R: tl.constexpr, BOX_C: tl.constexpr, COLS: tl.constexpr,
                     NUM_STAGES: tl.constexpr):
    """Sum this program's [BOX_R, BOX_C] boxes of a [rows, COLS] view (boxes ``pid, pid + P, ...``
    in row-major box order) through TMA loads into ``sums[pid]``."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    per_row = COLS // BOX_C
    boxes = tl.cdiv(rows, BOX_R) * per_row
    acc = tl.zeros((BOX_R, BOX_C), dtype=tl.float32)
    for box in tl.range(pid, boxes, programs, num_stages=NUM_STAGES):
        acc += desc.load([(box // per_row) * BOX_R, (box % per_row) * BOX_C]).to(tl.float32)
    tl.store(sums_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _mlp_pattern_kernel(w_gu_ptr, w_down_t_ptr, x_ptr, res_ptr, norm_w_ptr, intermediate, sums_ptr, out_ptr,
                        K: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, REDUCE: tl.constexpr,
                        PROLOGUE: tl.constexpr, ATOMIC: tl.constexpr, ROTATE: tl.constexpr,
                        SPLIT: tl.constexpr = 1, VEC4: tl.constexpr = False):
    """The fused MLP kernel's loads (app/kernels/triton_fused_mlp.py: tiles ``pid, pid + P, ...``
    of BLOCK_N / 2 gate rows, their up rows ``intermediate`` further, and as many rows of down's
    transpose) summed into ``sums[pid]``: with ``REDUCE`` its per-tile dot products over K (a
    reduction across the program's threads) before down's part, else only element-wise adds.
    ``PROLOGUE``: x is the kernel's (float32 x + the residual, rms-normed with its weight) before
    the loop; ``ATOMIC``: the program's [K] part added into ``out`` with float32 atomics, as the
    kernel ends (else one sum stored); ``ROTATE``: each program walks its columns from
    ``pid * 256`` on (modulo K), so that programs ending together spread their atomics over the
    output's lines instead of all starting at its first; ``SPLIT``: into row ``pid % SPLIT`` of a
    ``[SPLIT, K]`` ``out`` (fewer adds to each address; a reader sums the rows); ``VEC4`` (CUDA,
    compute capability 9.0): four floats an atomic (``red.global.add.v4.f32``)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, K)
    if ROTATE:
        cols = (cols + pid * 256) % K
    pairs: tl.constexpr = BLOCK_N // 2
    idx = tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + cols).to(tl.float32)
    rms = 1.0
    if PROLOGUE:
        x += tl.load(res_ptr + cols).to(tl.float32)
        rms = tl.sqrt(tl.sum(x * x, axis=0) / K + 1e-5)
        x = x * tl.load(norm_w_ptr + cols).to(tl.float32)
    acc = tl.zeros((K,), tl.float32)
    for tile in tl.range(pid, intermediate // pairs, programs, num_stages=NUM_STAGES):
        rows = tile * pairs + idx % pairs + (idx // pairs) * intermediate
        w = tl.load(w_gu_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]).to(tl.float32)
        act_rows = tile * pairs + tl.arange(0, pairs)
        w_down = tl.load(w_down_t_ptr + act_rows.to(tl.int64)[:, None] * K + cols[None, :]).to(tl.float32)
        if REDUCE:
            y = tl.sum(w * x[None, :], axis=1) / rms
            gate, up = tl.split(tl.permute(tl.reshape(y, (2, pairs)), (1, 0)))
            act = gate / (1.0 + tl.exp(-gate)) * up
            acc += tl.sum(act[:, None] * w_down, axis=0)
        else:
            acc += tl.sum(w, axis=0) + tl.sum(w_down, axis=0)
    if ATOMIC:
        targets = out_ptr + (pid % SPLIT) * K + cols
        if VEC4:
            tl.inline_asm_elementwise(
                "red.relaxed.gpu.global.add.v4.f32 [$4], {$8, $9, $10, $11};\n\tmov.b32 $0, 0;\n\t"
                "mov.b32 $1, 0;\n\tmov.b32 $2, 0;\n\tmov.b32 $3, 0;",
                "=r,=r,=r,=r,l,l,l,l,r,r,r,r", [targets.to(tl.int64), acc.to(tl.int32, bitcast=True)], dtype=tl.int32,
                is_pure=False, pack=4)
        else:
            tl.atomic_add(targets, acc, sem="relaxed")
    else:
        tl.store(sums_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _mlp_warp_rows_kernel(w_gu_ptr, w_down_t_ptr, x_ptr, res_ptr, norm_w_ptr, intermediate, sums_ptr, out_ptr,
                          K: tl.constexpr, PAIRS: tl.constexpr, NUM_STAGES: tl.constexpr, PROLOGUE: tl.constexpr,
                          ATOMIC: tl.constexpr):
    """The MLP pattern with its dots (``REDUCE``) in a layout where each warp owns whole rows: a
    tile is viewed chunk-major, ``[K / 256, PAIRS, 256]`` (element ``(c, p, e)`` is column
    ``256 c + e`` of pair p's row), so that triton puts one warp on each pair (launch PAIRS warps),
    a row's 256-column chunks in each thread's registers and its columns across the warp's lanes:
    the gate and up dots reduce by shuffles alone, with no shared memory and no barrier. Each warp
    keeps its own x and its own ``[K]`` float32 part of down's output (64 + 64 values a thread at
    K = 2048), summed over the warps once, at the end."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    chunks: tl.constexpr = K // 256
    pairs = tl.arange(0, PAIRS)[None, :, None]
    cols = (tl.arange(0, chunks)[:, None, None] * 256 + tl.arange(0, 256)[None, None, :]) + 0 * pairs
    x = tl.load(x_ptr + cols).to(tl.float32)  # [chunks, PAIRS, 256]: every warp a copy
    rms = 1.0
    if PROLOGUE:
        x += tl.load(res_ptr + cols).to(tl.float32)
        rms = tl.sqrt(tl.sum(tl.sum(tl.sum(x * x, axis=2), axis=1), axis=0) / (K * PAIRS) + 1e-5)
        x = x * tl.load(norm_w_ptr + cols).to(tl.float32)
    acc = tl.zeros((chunks, PAIRS, 256), tl.float32)
    for tile in tl.range(pid, intermediate // PAIRS, programs, num_stages=NUM_STAGES):
        rows = (tile * PAIRS + pairs).to(tl.int64)
        gate_w = tl.load(w_gu_ptr + rows * K + cols).to(tl.float32)
        up_w = tl.load(w_gu_ptr + (rows + intermediate) * K + cols).to(tl.float32)
        down_w = tl.load(w_down_t_ptr + rows * K + cols).to(tl.float32)
        gate = tl.sum(tl.sum(gate_w * x, axis=2), axis=0) / rms  # [PAIRS]: within each warp
        up = tl.sum(tl.sum(up_w * x, axis=2), axis=0) / rms
        act = gate / (1.0 + tl.exp(-gate)) * up
        acc += act[None, :, None] * down_w
    part = tl.sum(acc, axis=1)  # [chunks, 256]: across the warps, once
    if ATOMIC:
        tl.atomic_add(out_ptr + tl.arange(0, chunks)[:, None] * 256 + tl.arange(0, 256)[None, :], part,
                      sem="relaxed")
    else:
        tl.store(sums_ptr + pid, tl.sum(tl.sum(part, axis=1), axis=0))


class Read(NamedTuple):
    """One triton read launch."""

    per_sm: int = 2
    warps: int = 8
    stages: int = 3
    tile: int = 4096  # elements (bf16): 8 KB
    chunked: bool = False
    cache: str = ""  # "" or ".cg" (cached in L2 only; triton 3.6 takes no ".cs" on a load)
    evict: str = ""  # "", "evict_first"

    def label(self) -> str:
        return (f"triton {self.per_sm}/SM {self.warps}w {self.stages}s tile {self.tile * 2 // 1024}KB"
                + (" chunked" if self.chunked else "") + (f" {self.cache}" if self.cache else "")
                + (f" {self.evict}" if self.evict else ""))


class Tma(NamedTuple):
    """One TMA read launch: [box_r, box_c] boxes."""

    per_sm: int = 2
    warps: int = 4
    stages: int = 4
    box_r: int = 32
    box_c: int = 256

    def label(self) -> str:
        return f"tma {self.per_sm}/SM {self.warps}w {self.stages}s box {self.box_r}x{self.box_c}"


READS = [Read(), Read(stages=4), Read(stages=6), Read(per_sm=1, stages=6), Read(per_sm=4),
         Read(warps=4), Read(warps=16), Read(tile=8192), Read(tile=8192, stages=4), Read(tile=16384, warps=16),
         Read(tile=2048, stages=6), Read(chunked=True), Read(chunked=True, stages=6), Read(cache=".cg"),
         Read(evict="evict_first"), Read(per_sm=8, warps=4, stages=4)]
TMAS = [Tma(), Tma(stages=6), Tma(box_r=64), Tma(box_r=16, stages=8), Tma(per_sm=1, stages=8),
        Tma(per_sm=4, stages=3), Tma(warps=8, box_r=64, stages=4), Tma(box_r=128, stages=3)]


class MlpPattern(NamedTuple):
    """The fused MLP's loads at its tuned launch (4 rows a tile, 8 warps, 3 stages, 2 an SM)."""

    reduce: bool = False
    per_sm: int = 2
    warps: int = 8
    stages: int = 3
    block_n: int = 4
    prologue: bool = False
    atomic: bool = False
    rotate: bool = False
    split: int = 1
    vec4: bool = False
    programs: int = 0  # > 0: this many programs instead of per_sm an SM
    warp_rows: bool = False  # the dots with a warp on each pair (_mlp_warp_rows_kernel): warps = block_n / 2

    def label(self) -> str:
        extras = [name.replace("_", " ") for name in ("prologue", "atomic", "rotate", "vec4", "warp_rows")
                  if getattr(self, name)]
        extras += [f"split {self.split}"] if self.split > 1 else []
        return (f"mlp loads{' + dots' if self.reduce else ''} {self.per_sm}/SM {self.warps}w {self.stages}s "
                f"{self.block_n} rows" + "".join(f" {e}" for e in extras)
                + (f" {self.programs} programs" if self.programs else ""))


DOTS = MlpPattern(reduce=True)
WHOLE = DOTS._replace(prologue=True, atomic=True)  # the kernel's work but its roundings
MLPS = [MlpPattern(), DOTS, DOTS._replace(prologue=True), DOTS._replace(atomic=True), WHOLE,
        WHOLE._replace(rotate=True), WHOLE._replace(programs=256), WHOLE._replace(programs=256, rotate=True),
        DOTS._replace(programs=256), WHOLE._replace(split=2), WHOLE._replace(split=4), WHOLE._replace(split=8),
        WHOLE._replace(programs=256, split=2), WHOLE._replace(programs=256, split=4), WHOLE._replace(vec4=True),
        WHOLE._replace(vec4=True, split=2), WHOLE._replace(programs=256, vec4=True, split=2)]
# The kernel's launch since variant 85: one program an SM (128 of them: 4,096 tiles evenly) at 4 stages.
MLPS += [MlpPattern(programs=128, per_sm=1, stages=4), DOTS._replace(programs=128, per_sm=1, stages=4),
         DOTS._replace(programs=128, per_sm=1, stages=4, prologue=True),
         DOTS._replace(programs=128, per_sm=1, stages=4, atomic=True), WHOLE._replace(programs=128, per_sm=1, stages=4)]
# A warp on each pair: per_sm as shared memory allows at 24 KB of weights a tile of 2 pairs.
WARP_ROWS = MlpPattern(reduce=True, warp_rows=True, warps=2, block_n=4)
MLPS += [WARP_ROWS._replace(per_sm=per_sm, stages=stages) for per_sm, stages in ((2, 3), (3, 3), (4, 2), (4, 3))]
MLPS += [WARP_ROWS._replace(warps=1, block_n=2, per_sm=per_sm, stages=stages)
         for per_sm, stages in ((4, 3), (6, 3), (8, 2), (8, 3))]
MLPS += [WARP_ROWS._replace(warps=4, block_n=8, per_sm=per_sm, stages=stages) for per_sm, stages in ((1, 3), (2, 2))]
MLPS += [WARP_ROWS._replace(prologue=True, atomic=True, per_sm=3), WARP_ROWS._replace(
    prologue=True, atomic=True, warps=1, block_n=2, per_sm=6)]


def mlp_pattern(mlp: MlpPattern, w_gu: torch.Tensor, w_down_t: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor, norm_w: torch.Tensor, sums: torch.Tensor, out: torch.Tensor) -> None:
    """``mlp``'s launch (``sums.numel()`` programs) over one layer's ``[2 * I, K]`` gate/up and
    ``[I, K]`` down-transposed weights; ``out`` ``[split * K]`` float32 takes the atomics."""
    intermediate, k = w_down_t.shape
    if mlp.warp_rows:
        if mlp.warps != mlp.block_n // 2 or mlp.split != 1 or mlp.rotate or mlp.vec4 or not mlp.reduce:
            raise ValueError(f"bench_read_rate: a warp-rows pattern takes a warp a pair and no split, rotation or "
                             f"vec4, got {mlp}")
        _mlp_warp_rows_kernel[(sums.numel(),)](w_gu, w_down_t, x, residual, norm_w, intermediate, sums, out, K=k,
                                               PAIRS=mlp.block_n // 2, NUM_STAGES=mlp.stages,
                                               PROLOGUE=mlp.prologue, ATOMIC=mlp.atomic,
                                               num_warps=mlp.warps, num_stages=mlp.stages)
        return
    _mlp_pattern_kernel[(sums.numel(),)](w_gu, w_down_t, x, residual, norm_w, intermediate, sums, out, K=k,
                                         BLOCK_N=mlp.block_n, NUM_STAGES=mlp.stages, REDUCE=mlp.reduce,
                                         PROLOGUE=mlp.prologue, ATOMIC=mlp.atomic, ROTATE=mlp.rotate,
                                         SPLIT=mlp.split, VEC4=mlp.vec4,
                                         num_warps=mlp.warps, num_stages=mlp.stages)


def triton_read(read: Read, buf: torch.Tensor, sums: torch.Tensor) -> None:
    """``read``'s launch over ``buf`` (flat bf16, whole tiles), one sum a program into ``sums``."""
    _read_kernel[(sums.numel(),)](buf, buf.numel() // read.tile, sums, TILE=read.tile, NUM_STAGES=read.stages,
                                  CHUNKED=read.chunked, CACHE=read.cache, EVICT=read.evict,
                                  num_warps=read.warps, num_stages=read.stages)


def tma_read(tma: Tma, desc: TensorDescriptor, rows: int, sums: torch.Tensor) -> None:
    _read_tma_kernel[(sums.numel(),)](desc, rows, sums, BOX_R=tma.box_r, BOX_C=tma.box_c, COLS=ROW,
                                      NUM_STAGES=tma.stages, num_warps=tma.warps, num_stages=tma.stages)


def buffers(mb: float, layers: int, device: str) -> list[torch.Tensor]:
    """``layers`` flat bf16 buffers of about ``mb`` MB, whole rows of ROW and of the largest tile."""
    quantum = max(ROW * 128, max(r.tile for r in READS))  # 128 rows: every TMA box height divides it
    elements = max(1, round(mb * 1e6 / 2 / quantum)) * quantum
    if elements >= 2**31:
        raise ValueError("bench_read_rate: buffers of fewer than 2**31 elements (the kernels' offsets are 32-bit)")
    return [torch.randn(elements, device=device, dtype=torch.bfloat16) for _ in range(layers)]


def check_sums(buf: torch.Tensor, sums: torch.Tensor) -> None:
    """The kernel read every element once (a float32 sum against torch's, in float64)."""
    expected = float(buf.double().sum())
    got = float(sums.double().sum())
    if abs(got - expected) > 1e-3 * max(1.0, abs(expected)) + 1.0:
        raise RuntimeError(f"bench_read_rate: a read kernel's sum {got} differs from {expected}")


def run(mb: float, layers: int, repeats: int, only: str | None, sms: int) -> list[dict[str, object]]:
    bufs = buffers(mb, layers, "cuda")
    nbytes = bufs[0].numel() * 2
    rows = bufs[0].numel() // ROW
    mats = [b.view(rows, ROW) for b in bufs]
    vec = torch.randn(ROW, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(rows, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(bufs[0])
    results = []

    def timed(label: str, calls: Callable[[], None], moved: int) -> None:
        if only and only not in label:
            return
        us = time_graph(calls, repeats) * 1000 / layers
        results.append({"label": label, "us": us, "tb_s": moved / us / 1e6})
        print(f"{label:<52} {us:8.2f} us  {moved / us / 1e6:5.2f} TB/s", flush=True)

    timed("torch copy (read + write)", lambda: [dst.copy_(b) for b in bufs], 2 * nbytes)
    timed("torch.mv (cuBLAS gemv)", lambda: [torch.mv(m, vec, out=out) for m in mats], nbytes)
    timed("torch sum", lambda: [b.sum() for b in bufs], nbytes)
    for read in READS:
        sums = torch.zeros(read.per_sm * sms, device="cuda", dtype=torch.float32)
        triton_read(read, bufs[0], sums)
        check_sums(bufs[0], sums)
        timed(read.label(), lambda read=read, sums=sums: [triton_read(read, b, sums) for b in bufs], nbytes)
    if rows % 3 == 0:  # the MLP's shape: rows of gate, up and down's transpose (the default --mb)
        intermediate = rows // 3
        x = torch.randn(ROW, device="cuda", dtype=torch.float32)
        norm_w = torch.rand(ROW, device="cuda", dtype=torch.bfloat16)
        acc = torch.zeros(8 * ROW, device="cuda", dtype=torch.float32)  # up to 8 rows (split)
        references: dict[bool, torch.Tensor] = {}  # by prologue: the first such atomic variant's output
        for mlp in MLPS:
            sums = torch.zeros(mlp.programs or mlp.per_sm * sms, device="cuda", dtype=torch.float32)
            if mlp.atomic and not (only and only not in mlp.label()):
                # each atomic variant's rows summed against the first's with its prologue
                acc.zero_()
                mlp_pattern(mlp, mats[0][:2 * intermediate], mats[0][2 * intermediate:], x, vec, norm_w, sums, acc)
                got = acc.view(8, ROW)[:mlp.split].sum(dim=0)
                reference = references.setdefault(mlp.prologue, got.clone())
                # Relative to the whole vector: elements near zero differ by the atomics' order.
                err = float((got - reference).norm() / reference.norm().clamp_min(1e-30))
                if not err < 1e-4:
                    raise RuntimeError(f"bench_read_rate: {mlp.label()}'s sums differ from the plain atomics' "
                                       f"(relative error {err:.3g})")
            timed(mlp.label(), lambda mlp=mlp, sums=sums: [
                mlp_pattern(mlp, m[:2 * intermediate], m[2 * intermediate:], x, vec, norm_w, sums, acc)
                for m in mats], nbytes)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for tma in TMAS:
        sums = torch.zeros(tma.per_sm * sms, device="cuda", dtype=torch.float32)
        descs = [TensorDescriptor.from_tensor(m, [tma.box_r, tma.box_c]) for m in mats]
        tma_read(tma, descs[0], rows, sums)
        check_sums(bufs[0], sums)
        timed(tma.label(), lambda tma=tma, sums=sums, descs=descs: [tma_read(tma, d, rows, sums) for d in descs],
              nbytes)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=100.7, help="MB a buffer (default: the 1B's MLP weights a layer)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", default=None, help="rows whose label holds this")
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_read_rate: needs a CUDA device (it times CUDA graphs); none is available here")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}; "
          f"{options.layers} buffers of {options.mb} MB", flush=True)
    results = run(options.mb, options.layers, options.repeats, options.only, props.multi_processor_count)
    if options.json:
        Path(options.json).write_text(json.dumps({"device": props.name, "mb": options.mb, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
