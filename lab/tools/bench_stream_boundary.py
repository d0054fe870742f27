"""What a kernel boundary costs between two weight streams, against one kernel streaming both (GPU).

    python lab/tools/bench_stream_boundary.py [--pairs 8.4,100.7;100.7,12.6] [--sizes 4,16,64,256]
                                          [--programs-per-sm 2] [--repeats 20] [--json PATH]

Why: a batch-1 step of the 1B runs five kernels a layer and loses ~13.6 µs a layer to them over
its weights' bytes; a fit of the lm_head and the fused MLP kernel gave ~4.2 µs a streaming kernel
over its bytes at ~4.48 TB/s (docs/gpu_notes.md, lead 1 (b)). A persistent megakernel would
stream one layer's weights without kernel boundaries, but each of its phases needs the one
before it, so it would pass a grid barrier instead. Whether that pays depends on what a boundary
between two streams costs when the bytes are the same, which this measures with a plain
streaming kernel (every program sums its tiles of a bf16 buffer, tiles ``pid, pid + P, ...``,
pipelined like the model's persistent kernels), in CUDA graphs over ``--layers`` copies of the
buffers (past the L2), µs a layer:

  A, B         each stream alone
  A | B        two launches, B after A
  A | B pdl    B a programmatic dependent of A that loads its first tile before it waits
  A+B          one launch, each program streaming its share of A, then of B (no barrier: a
               bound, as if B needed nothing of A)
  A+B barrier  one launch with a grid barrier between the two streams, each program's first 1
               or 4 tiles of B loaded before the barrier and used after it (what a megakernel
               phase boundary could do)

So ``A | B`` − ``A+B`` is what a kernel boundary between streams costs, and ``A+B barrier`` −
``A+B`` what a barrier costs in its place. ``--sizes`` times single streams of those MB for the
fit time = bytes / rate + fixed cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv import time_graph  # noqa: E402  (lab/tools/, this script's folder, is on sys.path)
from bench_grid_barrier import grid_barrier  # noqa: E402

TILE = 4096  # bf16 elements a tile (8 KB), as the fused MLP kernel's gate_up tile (4 rows x 2048 x 2 halves / 2)
PAIRS = "8.4,100.7;100.7,12.6"  # o then the MLP, the MLP then the next qkv (MB of the 1B's weights)
EARLY_TILES = (1, 4)  # tiles of B a program holds across the barrier (8 and 32 registers a thread)


@triton.jit
def _first_tiles(ptr, pid, programs, tiles, offsets, COUNT: tl.constexpr, TILE: tl.constexpr):
    """This program's first ``COUNT`` tiles (``pid, pid + P, ...``) as one ``[COUNT, TILE]`` load,
    zeros past ``tiles``: issued now, used later (a load is waited for only at its first use)."""
    index = pid + programs * tl.arange(0, COUNT)
    return tl.load(ptr + index[:, None] * TILE + offsets[None, :], mask=(index < tiles)[:, None], other=0.0)


@triton.jit
def _stream_kernel(a_ptr, a_tiles, b_ptr, b_tiles, sums_ptr, counter_ptr, TILE: tl.constexpr,
                   NUM_STAGES: tl.constexpr, TRIGGER: tl.constexpr, PRELOAD: tl.constexpr,
                   BARRIER: tl.constexpr, EARLY: tl.constexpr):
    """Sum this program's tiles of ``a`` (``pid, pid + P, ...`` of ``a_tiles``), then of ``b``,
    into ``sums[pid]`` (float32). ``TRIGGER``: let a programmatic dependent launch at once;
    ``PRELOAD``: launched as one, load the first ``EARLY`` tiles of ``a`` before waiting for the
    kernel before; ``BARRIER``: a grid barrier between the streams (every program resident), the
    first ``EARLY`` tiles of ``b`` loaded before it and added after it (as a megakernel phase
    would hold its next weights across the barrier)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offsets = tl.arange(0, TILE)
    acc = tl.zeros((TILE,), dtype=tl.float32)
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    start = pid
    if PRELOAD:
        early_a = _first_tiles(a_ptr, pid, programs, a_tiles, offsets, EARLY, TILE)
        tl.extra.cuda.gdc_wait()
        acc += tl.sum(early_a.to(tl.float32), axis=0)
        start = pid + EARLY * programs
    for tile in tl.range(start, a_tiles, programs, num_stages=NUM_STAGES):
        acc += tl.load(a_ptr + tile * TILE + offsets).to(tl.float32)
    b_start = pid
    if BARRIER:
        early_b = _first_tiles(b_ptr, pid, programs, b_tiles, offsets, EARLY, TILE)
        grid_barrier(counter_ptr, programs)
        acc += tl.sum(early_b.to(tl.float32), axis=0)
        b_start = pid + EARLY * programs
    for tile in tl.range(b_start, b_tiles, programs, num_stages=NUM_STAGES):
        acc += tl.load(b_ptr + tile * TILE + offsets).to(tl.float32)
    tl.store(sums_ptr + pid, tl.sum(acc, axis=0))


def stream(a: torch.Tensor, b: torch.Tensor | None, sums: torch.Tensor, counter: torch.Tensor, *,
           num_stages: int = 3, trigger: bool = False, preload: bool = False, barrier: bool = False,
           early_tiles: int = 1) -> None:
    """One launch over ``sums.numel()`` programs: the sum of each program's tiles of ``a`` (and
    then ``b``) into ``sums``; flat bf16 buffers of whole tiles. ``barrier`` needs every program
    resident and ``counter`` at 0 (it is left at the program count); ``early_tiles`` (a power of
    two): the tiles a program loads before ``preload``'s wait or ``barrier``."""
    if a.numel() % TILE or (b is not None and b.numel() % TILE):
        raise ValueError(f"stream: buffers must hold whole tiles of {TILE} elements")
    if max(a.numel(), b.numel() if b is not None else 0) >= 2**31:
        raise ValueError("stream: buffers of fewer than 2**31 elements (the kernel's offsets are 32-bit)")
    if early_tiles < 1 or early_tiles & (early_tiles - 1):
        raise ValueError(f"stream: early_tiles must be a power of two, got {early_tiles}")
    if (trigger or preload) and a.device.type != "cuda":
        raise ValueError("stream: programmatic dependent launch needs a CUDA device")
    launch = {"launch_pdl": True} if preload else {}  # only when on: a plain launch otherwise
    _stream_kernel[(sums.numel(),)](
        a, a.numel() // TILE, b if b is not None else a, b.numel() // TILE if b is not None else 0, sums, counter,
        TILE=TILE, NUM_STAGES=num_stages, TRIGGER=trigger, PRELOAD=preload, BARRIER=barrier, EARLY=early_tiles,
        num_warps=8, num_stages=num_stages, **launch)


def buffers(mb: float, layers: int) -> list[torch.Tensor]:
    """``layers`` bf16 buffers of about ``mb`` MB each (whole tiles), random."""
    tiles = max(1, round(mb * 1e6 / (2 * TILE)))
    return [torch.randn(tiles * TILE, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]


def measure_pair(mb_a: float, mb_b: float, programs: int, layers: int, repeats: int) -> dict[str, float]:
    """µs a layer of each row of the module docstring for one pair of stream sizes."""
    a_bufs, b_bufs = buffers(mb_a, layers), buffers(mb_b, layers)
    sums = torch.zeros(programs, dtype=torch.float32, device="cuda")
    sums_b = torch.zeros_like(sums)
    counters = torch.zeros(layers, dtype=torch.int32, device="cuda")

    def timed(calls) -> float:
        return time_graph(calls, repeats) * 1000 / layers

    def fused_barrier(early: int) -> None:
        counters.zero_()
        for i in range(layers):
            stream(a_bufs[i], b_bufs[i], sums, counters[i:i + 1], barrier=True, early_tiles=early)

    fused_barrier(EARLY_TILES[-1])  # its sums are the last layer's: checked before any timing
    expected = float(a_bufs[-1].float().sum() + b_bufs[-1].float().sum())
    got = float(sums.sum())
    if abs(got - expected) > 1e-3 * max(1.0, abs(expected)) + 1.0:
        raise RuntimeError(f"the barrier kernel's sums {got} differ from {expected}")
    return {
        "a_mb": mb_a, "b_mb": mb_b,
        "a_us": timed(lambda: [stream(a, None, sums, counters) for a in a_bufs]),
        "b_us": timed(lambda: [stream(b, None, sums, counters) for b in b_bufs]),
        "a_then_b_us": timed(lambda: [(stream(a, None, sums, counters), stream(b, None, sums_b, counters))
                                      for a, b in zip(a_bufs, b_bufs)]),
        "a_then_b_pdl_us": timed(lambda: [(stream(a, None, sums, counters, trigger=True),
                                           stream(b, None, sums_b, counters, preload=True))
                                          for a, b in zip(a_bufs, b_bufs)]),
        "fused_us": timed(lambda: [stream(a, b, sums, counters) for a, b in zip(a_bufs, b_bufs)]),
        **{f"fused_barrier_{early}_us": timed(lambda early=early: fused_barrier(early)) for early in EARLY_TILES},
    }


def measure_sizes(sizes: list[float], programs: int, layers: int, repeats: int) -> list[dict[str, float]]:
    """µs of one stream of each size, and the bytes' rate."""
    sums = torch.zeros(programs, dtype=torch.float32, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = []
    for mb in sizes:
        bufs = buffers(mb, layers)
        us = time_graph(lambda: [stream(a, None, sums, counter) for a in bufs], repeats) * 1000 / layers
        mb_read = bufs[0].numel() * 2 / 1e6  # whole tiles: within 8 KB of the size asked for
        rows.append({"mb": mb_read, "us": us, "tb_s": mb_read / us})
    return rows


def fit(rows: list[dict[str, float]]) -> tuple[float, float]:
    """Least squares us = bytes / rate + fixed: (rate in TB/s, fixed µs)."""
    xs = [r["mb"] for r in rows]
    ys = [r["us"] for r in rows]
    slope, intercept = statistics.linear_regression(xs, ys)
    return 1.0 / slope, intercept  # MB/us = TB/s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default=PAIRS, help="MB of A and B, pairs separated by ';'")
    parser.add_argument("--sizes", default="4,16,64,256", help="MB of single streams for the fit ('' for none)")
    parser.add_argument("--programs-per-sm", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_stream_boundary: needs a CUDA device (it times CUDA graphs); none is available here")
    props = torch.cuda.get_device_properties(0)
    programs = options.programs_per_sm * props.multi_processor_count
    print(f"{props.name}, {programs} programs, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    result: dict[str, object] = {"device": props.name, "programs": programs, "pairs": [], "sizes": []}
    if options.sizes:
        rows = measure_sizes([float(s) for s in options.sizes.split(",")], programs, options.layers, options.repeats)
        for row in rows:
            print(f"stream {row['mb']:7.1f} MB: {row['us']:8.2f} us  {row['tb_s']:.2f} TB/s", flush=True)
        rate, fixed = fit(rows)
        print(f"fit: {rate:.2f} TB/s + {fixed:.2f} us a kernel", flush=True)
        result["sizes"], result["fit"] = rows, {"tb_s": rate, "fixed_us": fixed}
    for pair in options.pairs.split(";"):
        mb_a, mb_b = (float(v) for v in pair.split(","))
        row = measure_pair(mb_a, mb_b, programs, options.layers, options.repeats)
        result["pairs"].append(row)  # type: ignore[union-attr]
        barriers = ", ".join(f"A+B barrier ({early} early) {row[f'fused_barrier_{early}_us']:.2f}"
                             for early in EARLY_TILES)
        print(f"A {mb_a} MB, B {mb_b} MB: A {row['a_us']:.2f}, B {row['b_us']:.2f}, A|B {row['a_then_b_us']:.2f}, "
              f"A|B pdl {row['a_then_b_pdl_us']:.2f}, A+B {row['fused_us']:.2f}, {barriers} us a layer; "
              f"boundary {row['a_then_b_us'] - row['fused_us']:+.2f}, barrier "
              f"{min(row[f'fused_barrier_{e}_us'] for e in EARLY_TILES) - row['fused_us']:+.2f}", flush=True)
    if options.json:
        Path(options.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
