"""Where a decode step's device time goes, from a Chrome trace of torch's profiler.

    python lab/tools/trace_gaps.py TRACE.json [--step-marker NAME] [--rows N] [--summary] [--gemv-roles]
                               [--boundaries] [--period NAME]

The profiler's table sums kernel durations. With programmatic dependent launch (``gemv-pdl``)
that sum misleads: a dependent kernel starts early and its wait counts as its own duration.
This reads when each kernel starts and ends on the device and reports, per kernel name, what it
adds to the timeline (its end minus the previous kernel's end) and the gap before it (its start
minus the previous kernel's end: negative where kernels overlap), and per step (steps end at
each ``--step-marker`` kernel, the greedy record kernel by default) the device period and the
share of it during which no kernel ran. ``--summary`` prints one JSON line last.

``--boundaries`` adds a table by boundary (the op before, in start order, and the op): the
median gap from the one's end to the other's start and the median of the other's end after the
one's, so that a boundary that widens shows apart from the others of the same kernel name.
``--period NAME`` prints the median time between the starts of consecutive ops named NAME
within a step (a batch-1 layer's period, with NAME one kernel that runs once a layer).

A gap is not always the device's: where the host call that queued an op (matched by the
trace's correlation ids: a kernel launch, a copy, a graph launch) returned only after the
previous op had ended, the device waited for the host for that long. That part of each gap is
reported as "host late" (per name, and as a share of the steps' span); under the profiler the
host runs slower than without it, so a host-late gap here may not exist in a plain run (compare
the engine's own device-busy share).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CALL_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})


class DeviceOp(NamedTuple):
    """One kernel, copy or memset as the device ran it (microseconds)."""

    name: str
    start: float
    end: float
    issued: float | None = None  # when the host call that queued it returned (None: not in the trace)


class NameCost(NamedTuple):
    """What one kernel name costs per step, on average."""

    name: str
    per_step: float  # occurrences per step
    duration_us: float  # mean of its own duration
    adds_us: float  # mean of its end minus the previous op's end
    gap_us: float  # mean of its start minus the previous op's end
    host_late_us: float = 0.0  # mean of the part of that gap before its host call returned


class TraceReport(NamedTuple):
    steps: int
    step_us_median: float
    step_us_mean: float
    idle_share: float  # of the steps' span, the time no op ran
    ops_per_step: float
    costs: list[NameCost]
    host_late_share: float = 0.0  # of the steps' span, the idle time the host had not yet queued the next op


def device_ops(trace: dict) -> list[DeviceOp]:
    """The device's ops in start order (all streams: our decode steps run on one), each with
    when its host call returned where the trace correlates the two."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    issued = {e["args"]["correlation"]: float(e["ts"]) + float(e.get("dur", 0.0))
              for e in events if e.get("cat") in HOST_CALL_CATEGORIES and "correlation" in e.get("args", {})}
    ops = [DeviceOp(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)),
                    issued.get(e.get("args", {}).get("correlation")))
           for e in events if e.get("cat") in DEVICE_CATEGORIES]
    return sorted(ops, key=lambda op: (op.start, op.end))


GEMV_ROLES = ("qkv", "o", "gate_up", "down")  # a decoder layer's linear layers, in launch order
# With fused-mlp a layer's MLP is one kernel (app/kernels/triton_fused_mlp.py), named "gemv:mlp".
FUSED_MLP_ROLES = ("qkv", "o", "mlp")
FUSED_MLP_KERNEL = "fused_mlp"


def label_gemv_roles(ops: list[DeviceOp], step_marker: str) -> list[DeviceOp]:
    """The ops with each gemv kernel (a name containing "gemv": the row-block and the persistent
    kernels alike, and the fused MLP's) renamed ``gemv:<role>`` by its place in its step: a
    batch-1 step launches L layers of GEMV_ROLES (FUSED_MLP_ROLES where the step has a fused MLP
    kernel), then the output projection (``gemv:lm_head``), so the i-th of a step's n role kernels
    takes roles[i % len(roles)] below len(roles) * ((n - 1) // len(roles)), lm_head after. Steps
    end at each ``step_marker`` op, as in :func:`analyse`."""
    labelled: list[DeviceOp] = []
    step: list[DeviceOp] = []

    def flush() -> None:
        kernels = [i for i, op in enumerate(step) if "gemv" in op.name or FUSED_MLP_KERNEL in op.name]
        fused = any(FUSED_MLP_KERNEL in step[i].name for i in kernels)
        roles = FUSED_MLP_ROLES if fused else GEMV_ROLES
        layers = (len(kernels) - 1) // len(roles)
        for place, i in enumerate(kernels):
            role = roles[place % len(roles)] if place < len(roles) * layers else "lm_head"
            step[i] = step[i]._replace(name=f"gemv:{role}")
        labelled.extend(step)
        step.clear()

    for op in ops:
        step.append(op)
        if step_marker in op.name:
            flush()
    flush()
    return labelled


def busy_time(ops: list[DeviceOp]) -> float:
    """The length of the union of the ops' intervals."""
    total, cover_end = 0.0, float("-inf")
    for op in ops:  # sorted by start
        if op.end <= cover_end:
            continue
        total += op.end - max(op.start, cover_end)
        cover_end = op.end
    return total


def step_marks(ops: list[DeviceOp], step_marker: str) -> list[int]:
    """The indices of the ops that end a step; at least two (one step), or ValueError."""
    marks = [i for i, op in enumerate(ops) if step_marker in op.name]
    if len(marks) < 2:
        raise ValueError(f"need at least two {step_marker!r} ops to delimit a step, found {len(marks)}")
    return marks


def analyse(ops: list[DeviceOp], step_marker: str) -> TraceReport:
    """Steps between consecutive ``step_marker`` ends; per-name costs over those steps."""
    marks = step_marks(ops, step_marker)
    periods = [ops[b].end - ops[a].end for a, b in zip(marks, marks[1:])]
    window = ops[marks[0] + 1: marks[-1] + 1]
    steps = len(periods)
    span = ops[marks[-1]].end - ops[marks[0]].end
    idle = span - busy_time(window)
    stats: dict[str, list[tuple[float, float, float, float]]] = defaultdict(list)
    previous_end = ops[marks[0]].end
    host_late = 0.0
    for op in window:
        late = 0.0 if op.issued is None else max(0.0, min(op.start, op.issued) - previous_end)
        host_late += late
        stats[op.name].append((op.end - op.start, op.end - previous_end, op.start - previous_end, late))
        previous_end = max(previous_end, op.end)
    costs = [NameCost(name, len(rows) / steps, *(statistics.fmean(r[i] for r in rows) for i in range(4)))
             for name, rows in stats.items()]
    costs.sort(key=lambda c: c.adds_us * c.per_step, reverse=True)
    return TraceReport(steps, statistics.median(periods), statistics.fmean(periods), idle / span,
                       len(window) / steps, costs, host_late / span)


class BoundaryCost(NamedTuple):
    """One boundary between two op names, medians over its occurrences (microseconds)."""

    before: str
    after: str
    per_step: float
    gap_us: float  # the after op's start minus the before op's end
    adds_us: float  # the after op's end minus the before op's end


def _window(ops: list[DeviceOp], step_marker: str) -> tuple[list[DeviceOp], int]:
    """The ops of whole steps (after the first ``step_marker`` op, through the last) and the
    number of steps, as :func:`analyse` delimits them."""
    marks = step_marks(ops, step_marker)
    return ops[marks[0] + 1: marks[-1] + 1], len(marks) - 1


def boundaries(ops: list[DeviceOp], step_marker: str) -> list[BoundaryCost]:
    """Each pair of consecutive ops (in start order) by their names, with the medians of the gap
    and of what the second adds after the first's end; most frequent first."""
    window, steps = _window(ops, step_marker)
    pairs: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for before, after in zip(window, window[1:]):
        pairs[before.name, after.name].append((after.start - before.end, after.end - before.end))
    costs = [BoundaryCost(before, after, len(rows) / steps, statistics.median(r[0] for r in rows),
                          statistics.median(r[1] for r in rows)) for (before, after), rows in pairs.items()]
    return sorted(costs, key=lambda c: c.per_step, reverse=True)


def period(ops: list[DeviceOp], name: str, step_marker: str) -> tuple[float, int]:
    """The median time between the starts of consecutive ops whose name contains ``name``, not
    counting pairs with a step's end between them; and how many pairs there were."""
    window, _ = _window(ops, step_marker)
    periods, last_start = [], None
    for op in window:
        if name in op.name:
            if last_start is not None:
                periods.append(op.start - last_start)
            last_start = op.start
        if step_marker in op.name:
            last_start = None
    if not periods:
        raise ValueError(f"no two ops named {name!r} within one step")
    return statistics.median(periods), len(periods)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--step-marker", default="_greedy_record_kernel",
                        help="a kernel that runs once at the end of every step (substring of its name)")
    parser.add_argument("--rows", type=int, default=20, help="kernel names to list")
    parser.add_argument("--summary", action="store_true", help="end with one JSON line")
    parser.add_argument("--gemv-roles", action="store_true",
                        help="name each gemv kernel by its role in a batch-1 step (qkv, o, gate_up, down per layer, "
                             "or qkv, o, mlp with fused-mlp; then lm_head)")
    parser.add_argument("--boundaries", action="store_true",
                        help="also list each boundary (op before -> op) with its median gap and adds")
    parser.add_argument("--period", metavar="NAME", default=None,
                        help="also print the median start-to-start time of consecutive NAME ops within a step")
    options = parser.parse_args(argv)
    try:
        ops = device_ops(json.loads(options.trace.read_text()))
        if options.gemv_roles:
            ops = label_gemv_roles(ops, options.step_marker)
        report = analyse(ops, options.step_marker)
        pair_costs = boundaries(ops, options.step_marker) if options.boundaries else []
        name_period = period(ops, options.period, options.step_marker) if options.period else None
    except (OSError, ValueError) as exc:
        print(f"trace_gaps: {exc}", file=sys.stderr)
        return 2
    print(f"{report.steps} steps: device period median {report.step_us_median:.1f} us, mean "
          f"{report.step_us_mean:.1f} us; idle {100 * report.idle_share:.1f} % (host late "
          f"{100 * report.host_late_share:.1f} %); {report.ops_per_step:.1f} ops a step")
    print(f"{'name':<60} {'/step':>6} {'dur us':>8} {'adds us':>8} {'gap us':>8} {'host late':>9} {'adds/step':>10}")
    for cost in report.costs[:options.rows]:
        print(f"{cost.name[:60]:<60} {cost.per_step:>6.1f} {cost.duration_us:>8.2f} {cost.adds_us:>8.2f} "
              f"{cost.gap_us:>8.2f} {cost.host_late_us:>9.2f} {cost.adds_us * cost.per_step:>10.1f}")
    if options.boundaries:
        print(f"{'boundary (before -> after)':<60} {'/step':>6} {'gap us':>8} {'adds us':>8}   (medians)")
        for pair in pair_costs[:options.rows]:
            label = f"{pair.before[:28]} -> {pair.after[:28]}"
            print(f"{label:<60} {pair.per_step:>6.1f} {pair.gap_us:>8.2f} {pair.adds_us:>8.2f}")
    if name_period is not None:
        print(f"period of {options.period}: median {name_period[0]:.2f} us over {name_period[1]} pairs")
    if options.summary:
        top = [[c.name[:40], round(c.per_step, 1), round(c.adds_us * c.per_step, 1), round(c.gap_us, 2),
                round(c.host_late_us, 2)] for c in report.costs[:6]]
        print(json.dumps({"steps": report.steps, "step_us_median": round(report.step_us_median, 1),
                          "idle_share": round(report.idle_share, 4), "host_late_share": round(report.host_late_share, 4),
                          "ops_per_step": round(report.ops_per_step, 1), "top_adds_us_per_step": top}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
