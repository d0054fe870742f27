"""tools/profile_decode.py as its users run it: a real process, its JSON line checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args: str) -> tuple[str, dict]:
    """Run tools/profile_decode.py on the CPU with ``args``: its stdout and its last line's JSON."""
    proc = subprocess.run([sys.executable, "tools/profile_decode.py", "--device", "cpu", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("overlap", "sort"), [("overlap-schedule=on", "host"), ("overlap-schedule=off", "device")])
def test_profiles_steady_decode_steps_and_leaves_the_engine_idle(tmp_path, overlap, sort):
    """Steady decode steps with and without overlap, the table sorted by host or by device time
    (on the CPU there are no device kernels: the device view is present and empty, and the
    table is still printed)."""
    trace = tmp_path / "trace.json"
    stdout, figures = run_tool("--batch-size", "8", "--input-len", "12", "--steps", "4", "--rows", "5",
                               "--trace", str(trace), "--kernel-options", overlap, "--sort", sort)
    assert figures["kernel_plan"]["overlap_schedule"] is (overlap == "overlap-schedule=on")
    assert figures["batch_size"] == 8 and figures["steps"] == 4 and figures["ms_per_step"] > 0
    timing = figures["step_timing"]
    assert timing["steps"] >= 4 + 5  # the profiled steps after the warm-up ones
    assert (timing["overlapped_steps"] > 0) is (overlap == "overlap-schedule=on")
    assert "Self CPU time total" in stdout
    assert json.loads(trace.read_text())["traceEvents"]
    if sort == "device":
        assert figures["device_ms_per_step"] == 0 and figures["kernels_per_step"] == 0
        assert figures["top_kernels_ms_per_step"] == []


def test_prefill_phase_profiles_every_prefill_step():
    stdout, figures = run_tool("--batch-size", "6", "--input-len", "40", "--rows", "4", "--phase", "prefill",
                               "--sort", "device")
    assert figures["phase"] == "prefill" and figures["batch_size"] == 6
    assert figures["steps"] >= 1 and figures["ms_per_step"] > 0
    timing = figures["step_timing"]
    # the warm-up generation's steps, then the profiled ones
    assert timing["steps"] >= figures["steps"] + 2
