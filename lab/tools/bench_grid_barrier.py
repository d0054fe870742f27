"""What a grid-wide barrier costs inside one persistent triton kernel, against a kernel boundary.

    python lab/tools/bench_grid_barrier.py [--phases 16] [--repeats 50] [--json PATH]

Why: a batch-1 decode step of the 1B model is ~100 dependent kernels (6 a layer), each a few µs
of work behind a launch gap that programmatic dependent launch (PDL) only partly hides; the 75 %
roofline target most likely needs one persistent kernel whose phases (qkv, attention, o,
gate_up, down) are separated by grid barriers instead (docs/gpu_notes.md, lead 1). That pays
only if a barrier is cheaper than the gap it replaces, so this measures both, per phase, from
CUDA graphs of:

  barrier:  one kernel of ``phases`` phases, one program per SM (or two), a barrier after each
            phase (an atomic ticket on a counter in global memory, then a spin on acquire loads)
  launches: ``phases`` launches of the same one-phase kernel, plain and as PDL dependents
            (each waits for the one before it, then lets the next one start)

Each phase does a token amount of work (every program writes a 16 KB slice), so the figures are
the fixed costs. The per-phase cost is the slope between 1 and ``phases`` phases (the graph's own
launch, and the counter's reset, cancel out).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for app

from bench_gemv import time_graph  # noqa: E402  (lab/tools/, this script's folder, is on sys.path)

SLICE = 4096  # float32 words each program writes a phase (16 KB)


@triton.jit
def grid_barrier(counter_ptr, target):
    """Wait until ``target`` tickets are on the counter, this program's included: every thread's
    stores first (block barrier), one release ticket a program, then acquire loads until the
    count is reached (the order that makes the other programs' stores visible after it)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    tl.debug_barrier()  # what the acquiring thread saw, for every thread of the program


@triton.jit
def _phases_kernel(counter_ptr, sink_ptr, errors_ptr, PHASES: tl.constexpr, BARRIER: tl.constexpr,
                   PDL: tl.constexpr, CHECK: tl.constexpr, SLICE_WORDS: tl.constexpr):
    """``PHASES`` phases of a token write each; with ``BARRIER`` a grid barrier after each, and
    with ``CHECK`` each program then reads the next program's slice and counts the words older
    than this phase (a barrier that lets a program through early shows there; a newer value is
    fine: that neighbour has already passed this barrier and written its next phase)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if PDL:  # a programmatic dependent: wait for the kernel before, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    words = tl.arange(0, SLICE_WORDS)
    neighbour = ((pid + 1) % programs) * SLICE_WORDS + words
    for phase in tl.static_range(PHASES):
        tl.store(sink_ptr + pid * SLICE_WORDS + words, tl.full((SLICE_WORDS,), phase + 1, tl.float32))
        if BARRIER:
            grid_barrier(counter_ptr, (phase + 1) * programs)
            if CHECK:
                seen = tl.load(sink_ptr + neighbour, cache_modifier=".cg")  # past L1: another SM wrote it
                tl.atomic_add(errors_ptr, tl.sum((seen < phase + 1).to(tl.int32), axis=0))


def run_phases(counter: torch.Tensor, sink: torch.Tensor, programs: int, phases: int, *, barrier: bool,
               pdl: bool = False, errors: torch.Tensor | None = None) -> None:
    """One launch of ``phases`` phases over ``programs`` programs (the counter must start at 0);
    with ``errors`` (int32, one word) the barrier's check adds its early-read words there."""
    launch = {"launch_pdl": True} if pdl else {}  # only when on: the interpreter knows no such option
    _phases_kernel[(programs,)](counter, sink, errors if errors is not None else counter, PHASES=phases,
                                BARRIER=barrier, PDL=pdl, CHECK=errors is not None, SLICE_WORDS=SLICE,
                                num_warps=4, **launch)


def measure(programs: int, phases: int, repeats: int) -> dict[str, float]:
    """µs per phase: a barrier inside one kernel, and a plain or PDL kernel boundary."""
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    sink = torch.zeros(programs * SLICE, dtype=torch.float32, device="cuda")

    def fused(n: int) -> float:
        def calls() -> None:
            counter.zero_()
            run_phases(counter, sink, programs, n, barrier=True)
        return time_graph(calls, repeats) * 1000

    def launches(n: int, pdl: bool) -> float:
        def calls() -> None:
            counter.zero_()  # the same memset as the fused graph's, so that it cancels
            for _ in range(n):
                run_phases(counter, sink, programs, 1, barrier=False, pdl=pdl)
        return time_graph(calls, repeats) * 1000

    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    counter.zero_()
    run_phases(counter, sink, programs, phases, barrier=True, errors=errors)  # the barrier holds first
    if int(errors) or int(counter) != phases * programs:
        raise RuntimeError(f"grid barrier failed at {programs} programs: {int(errors)} words read early, "
                           f"counter {int(counter)} for {phases * programs} tickets")
    slope = phases - 1
    return {
        "programs": programs,
        "barrier_us": (fused(phases) - fused(1)) / slope,
        "launch_us": (launches(phases, False) - launches(1, False)) / slope,
        "pdl_launch_us": (launches(phases, True) - launches(1, True)) / slope,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phases", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    if options.phases < 2:
        parser.error("--phases must be at least 2 (the cost is a slope)")
    if not torch.cuda.is_available():
        sys.exit("bench_grid_barrier: needs a CUDA device (it times CUDA graphs); none is available here")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"{props.name}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows = []
    for programs in (sms, 2 * sms):  # one and two programs an SM: all resident, as a barrier needs
        row = measure(programs, options.phases, options.repeats)
        rows.append(row)
        print(f"{programs:>4} programs: barrier {row['barrier_us']:6.2f} us a phase | kernel boundary "
              f"{row['launch_us']:6.2f} us, with PDL {row['pdl_launch_us']:6.2f} us", flush=True)
    if options.json:
        Path(options.json).write_text(json.dumps({"device": props.name, "phases": options.phases, "rows": rows}))


if __name__ == "__main__":
    main()
