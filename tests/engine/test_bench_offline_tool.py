"""tools/bench_offline.py as its users run it: a real process on the CPU, its JSON line checked,
with the engine switches it shares with profile_decode.py (tools/engine_flags.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    """The tool on the CPU with ``args``, without triton's interpreter (as a user's shell has it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "tools/bench_offline.py", "--device", "cpu", *args],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_reports_throughput_steps_and_the_switches_as_resolved():
    proc = run_tool("--num-prompts", "6", "--input-len", "10", "--output-len", "5", "--max-total-tokens", "64",
                    "--overlap-schedule")
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["num_prompts"] == 6 and figures["output_len"] == 5 and figures["output_tokens_per_s"] > 0
    # Asked for, overlap is on; the kernel switches resolve to off on a CPU.
    assert figures["overlap_schedule"] is True
    assert not any(figures[name] for name in ("fused_kernels", "triton_gemv", "fused_decode", "gemv_pdl",
                                              "fused_qkv_rotary", "fused_silu_out", "fused_greedy", "fused_kv_alloc",
                                              "graph_inputs_advance", "fused_split_reduce", "gemv_pdl_mode", "copy_stream", "decode_tiling",
                                              "gemv_rows_config", "gemv_config"))
    assert figures["copy_stream"] == 0  # the most rows a step copies out on the side stream: none on a CPU
    timing = figures["step_timing"]
    assert timing["overlapped_steps"] > 0 and timing["steps"] >= 5


def test_a_switch_the_cpu_cannot_serve_is_a_clear_error():
    proc = run_tool("--num-prompts", "1", "--input-len", "4", "--output-len", "2", "--fused-greedy")
    assert proc.returncode != 0
    assert "--fused-greedy needs a CUDA device" in proc.stderr and "TRITON_INTERPRET=1" in proc.stderr


def test_repeats_report_each_run_and_the_median_one():
    """--repeats 3: three measured runs in one process, each run's throughput listed, the figures
    (throughput, steps, step timing) the median run's; --repeats 0 is a usage error naming the flag."""
    proc = run_tool("--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--max-total-tokens", "64",
                    "--repeats", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = figures["runs_output_tokens_per_s"]
    assert len(runs) == 3 and all(value > 0 for value in runs)
    assert figures["output_tokens_per_s"] == sorted(runs)[1]
    assert figures["forward_steps"] == figures["step_timing"]["steps"] >= 4
    proc = run_tool("--num-prompts", "1", "--input-len", "4", "--output-len", "2", "--repeats", "0")
    assert proc.returncode == 2 and "--repeats must be at least 1, got 0" in proc.stderr
