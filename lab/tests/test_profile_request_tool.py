"""lab/tools/profile_request.py as its users run it: a real process on the CPU, its JSON line checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "lab/tools/profile_request.py", *args, "--device", "cpu"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_profile_request_times_and_profiles_its_requests():
    proc = run_tool("--input-len", "20", "--output-len", "3", "--repeats", "2", "--rows", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["input_len"] == 20 and figures["output_len"] == 3 and figures["repeats"] == 2
    assert 0 < figures["ms_min"] <= figures["ms_median"] <= figures["ms_max"]
    assert figures["step_timing"]["steps"] == 2 * 3  # only the timed requests' steps
    assert "=== by cumulative time, 2 requests" in proc.stdout and "=== by tottime time, 2 requests" in proc.stdout
