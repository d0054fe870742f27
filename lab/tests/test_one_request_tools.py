"""lab/tools/bench_start_streams.py and lab/tools/profile_request.py (both on lab/tools/one_request.py) as their
users run them: real processes on the CPU, their JSON lines checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args: str, tool: str = "bench_start_streams.py") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"lab/tools/{tool}", *args, "--device", "cpu"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_plain_mode_times_every_request_and_counts_their_steps():
    proc = run_tool("plain", "--input-len", "12", "--output-len", "6", "--requests", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["mode"] == "plain" and len(figures["ms"]) == 3
    assert min(figures["ms"]) <= figures["ms_median"] <= max(figures["ms"]) and figures["ms_median"] > 0
    assert figures["prefill_graph_tokens"] == []  # no CUDA graphs on the CPU
    assert figures["step_timing"]["steps"] == 3 * 6  # a prefill step then five decode steps a request


def test_a_stream_mode_off_cuda_is_refused_by_name():
    for mode in ("extra-stream", "extra-high-priority", "extra-before-build", "extra-copy"):
        proc = run_tool(mode, "--output-len", "2")
        assert proc.returncode != 0
        assert f"{mode} needs a CUDA device" in proc.stderr


def test_profile_request_times_and_profiles_its_requests():
    proc = run_tool("--input-len", "20", "--output-len", "3", "--repeats", "2", "--rows", "3",
                    tool="profile_request.py")
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["input_len"] == 20 and figures["output_len"] == 3 and figures["repeats"] == 2
    assert 0 < figures["ms_min"] <= figures["ms_median"] <= figures["ms_max"]
    assert figures["step_timing"]["steps"] == 2 * 3  # only the timed requests' steps
    assert "=== by cumulative time, 2 requests" in proc.stdout and "=== by tottime time, 2 requests" in proc.stdout
