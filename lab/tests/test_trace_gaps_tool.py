"""lab/tools/trace_gaps.py on a hand-built Chrome trace: its step periods, idle share and per-kernel
costs (what each kernel adds to the device timeline, the gap before it) are exact arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _event(name: str, ts: float, dur: float, cat: str = "kernel", correlation: int | None = None) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def _trace(path: Path) -> Path:
    """Three steps of 100 us: gemv 10-40, an overlapping dependent gemv 35-70, a copy 75-80 and
    the record kernel 90-100 (so 15 us of each step idle). The host calls that queue them: the
    gemvs' well ahead, the copy's returning at 78 and the record's at 85 (the device waited for
    the host 5 us before each); other host events are ignored."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]
    for step in range(3):
        base, ids = 100.0 * step, 10 * step
        events += [_event("_gemv_kernel", base + 10, 30, correlation=ids + 1),
                   _event("_gemv_kernel", base + 35, 35, correlation=ids + 2),
                   _event("Memcpy DtoD", base + 75, 5, "gpu_memcpy", correlation=ids + 3),
                   _event("_greedy_record_kernel", base + 90, 10, correlation=ids + 4),
                   _event("cudaLaunchKernel", base - 20, 2, "cuda_runtime", ids + 1),
                   _event("cudaLaunchKernel", base - 15, 2, "cuda_runtime", ids + 2),
                   _event("cudaMemcpyAsync", base + 70, 8, "cuda_runtime", ids + 3),
                   _event("cudaLaunchKernel", base + 83, 2, "cuda_runtime", ids + 4)]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "lab/tools/trace_gaps.py", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_steps_idle_and_costs(tmp_path: Path) -> None:
    proc = _run(str(_trace(tmp_path / "t.json")), "--summary")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    # Steps end at each record kernel: ends at 100, 200, 300 -> two periods of 100 us.
    assert summary["steps"] == 2
    assert summary["step_us_median"] == pytest.approx(100.0)
    assert summary["ops_per_step"] == pytest.approx(4.0)
    # Busy per step: 10..70 (60) + 75..80 (5) + 90..100 (10) = 75 of 100 -> 25 % idle.
    assert summary["idle_share"] == pytest.approx(0.25)
    top = {name: (per_step, adds, gap, late) for name, per_step, adds, gap, late in summary["top_adds_us_per_step"]}
    # Two gemvs a step: the first adds 40 - 0 (after the record's end at 0 + 10 idle) = 40, the
    # second 70 - 40 = 30 (gap -5: it overlaps); mean gap (10 + -5) / 2 = 2.5; queued in time.
    assert top["_gemv_kernel"] == (2.0, 70.0, 2.5, 0.0)
    # The record's gap of 10 after the copy's end at 80: its launch returned at 85, so 5 of it
    # waited for the host; the copy's gap 70..75 entirely (its call returned at 78 > 75).
    assert top["_greedy_record_kernel"] == (1.0, 20.0, 10.0, 5.0)
    assert top["Memcpy DtoD"] == (1.0, 10.0, 5.0, 5.0)
    assert summary["host_late_share"] == pytest.approx(0.1)  # 10 of each step's 100 us


def test_needs_step_markers(tmp_path: Path) -> None:
    proc = _run(str(_trace(tmp_path / "t.json")), "--step-marker", "no_such_kernel")
    assert proc.returncode == 2
    assert "need at least two 'no_such_kernel' ops" in proc.stderr


def test_boundaries_and_period(tmp_path: Path) -> None:
    """--boundaries: each pair of consecutive ops in start order, with the medians of the gap and
    of what the second adds; --period: start to start of one name within a step."""
    proc = _run(str(_trace(tmp_path / "t.json")), "--boundaries", "--period", "_gemv")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("boundary"))) + 1:-1]
    # A row: "before -> after" in 60 columns, then per step, gap and adds.
    rows = {tuple(part.strip() for part in line[:60].split(" -> ")): [float(v) for v in line[60:].split()]
            for line in table}
    # The two steps after the first record: gemv 10-40 then gemv 35-70 (gap -5, adds 30), the copy
    # at 75-80 (gap 5, adds 10), the record at 90-100 (gap 10, adds 20); between the steps the
    # record ends at 200 and the next gemv starts at 210 (once in two steps).
    assert rows[("_gemv_kernel", "_gemv_kernel")] == [1.0, -5.0, 30.0]
    assert rows[("_gemv_kernel", "Memcpy DtoD")] == [1.0, 5.0, 10.0]
    assert rows[("Memcpy DtoD", "_greedy_record_kernel")] == [1.0, 10.0, 20.0]
    assert rows[("_greedy_record_kernel", "_gemv_kernel")] == [0.5, 10.0, 40.0]
    assert len(rows) == 4
    # Gemv starts at 10 and 35 in each step: 25 us; the pair across a step's end is not counted.
    assert lines[-1] == "period of _gemv: median 25.00 us over 2 pairs"


def test_a_period_needs_two_ops_in_a_step(tmp_path: Path) -> None:
    proc = _run(str(_trace(tmp_path / "t.json")), "--period", "Memcpy")
    assert proc.returncode == 2
    assert "no two ops named 'Memcpy' within one step" in proc.stderr


def _batch1_trace(tmp_path: Path, layer: dict[str, tuple[str, float]]) -> Path:
    """Three batch-1 steps back to back, each two layers of ``layer``'s kernels (role: (kernel
    name, duration)), then the lm_head and the greedy record; the trace's path."""
    events = []
    t = 0.0
    for _step in range(3):
        for _layer in range(2):
            for name, dur in layer.values():
                events.append(_event(name, t, dur))
                t += dur
        events.append(_event("gemv_rows_kernel", t, 120))  # lm_head
        t += 120
        events.append(_event("_greedy_record_kernel", t, 2))
        t += 2
    path = tmp_path / "roles.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_gemv_roles_name_each_gemv_by_its_place_in_the_step(tmp_path: Path) -> None:
    """--gemv-roles: two layers of qkv, o, gate_up, down then the lm_head a step, the row-block and
    the persistent kernels alike; each role's row holds its own ops (per step and what they add)."""
    durations = {"qkv": 5, "o": 4, "gate_up": 18, "down": 9}
    path = _batch1_trace(tmp_path, {role: ("gemv_rows_kernel" if role == "gate_up" else "_gemv_kernel", dur)
                                    for role, dur in durations.items()})
    proc = _run(str(path), "--gemv-roles", "--rows", "10")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:]}
    assert set(rows) == {"gemv:qkv", "gemv:o", "gemv:gate_up", "gemv:down", "gemv:lm_head", "_greedy_record_kernel"}
    for role, dur in durations.items():
        per_step, duration, adds = (float(v) for v in rows[f"gemv:{role}"][1:4])
        assert (per_step, duration, adds) == (2.0, dur, dur)  # back to back: each adds its duration
    assert [float(v) for v in rows["gemv:lm_head"][1:4]] == [1.0, 120.0, 120.0]


def test_gemv_roles_with_the_fused_mlp_kernel(tmp_path: Path) -> None:
    """--gemv-roles with fused-mlp's kernel: a layer is qkv, o and the one MLP kernel."""
    durations = {"qkv": 5, "o": 4, "mlp": 27}
    path = _batch1_trace(tmp_path, {role: ("_fused_mlp_kernel" if role == "mlp" else "_gemv_kernel", dur)
                                    for role, dur in durations.items()})
    proc = _run(str(path), "--gemv-roles", "--rows", "10")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:]}
    assert set(rows) == {"gemv:qkv", "gemv:o", "gemv:mlp", "gemv:lm_head", "_greedy_record_kernel"}
    for role, dur in durations.items():
        assert [float(v) for v in rows[f"gemv:{role}"][1:4]] == [2.0, dur, dur]
    assert [float(v) for v in rows["gemv:lm_head"][1:4]] == [1.0, 120.0, 120.0]
