"""tools/bench_offline.py as its users run it: a real process on the CPU, its JSON line checked,
with the engine flags it shares with the server and profile_decode.py (EngineConfig's)."""

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


def test_reports_throughput_steps_and_the_kernel_plan_as_resolved():
    proc = run_tool("--num-prompts", "6", "--input-len", "10", "--output-len", "5", "--max-total-tokens", "64",
                    "--kernel-options", "overlap-schedule=on")
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["num_prompts"] == 6 and figures["output_len"] == 5 and figures["output_tokens_per_s"] > 0
    # Asked for, overlap is on; every kernel of the plan resolves to torch's on a CPU.
    plan = figures["kernel_plan"]
    assert plan["overlap_schedule"] is True
    assert plan["prefill_attention"] == plan["decode_attention"] == "torch"
    assert not any(plan[name] for name in ("fused_kernels", "triton_gemv", "fused_decode", "gemv_pdl",
                                           "fused_qkv_rotary", "fused_silu_out", "fused_mlp", "fused_greedy",
                                           "fused_kv_alloc", "cuda_graphs", "graph_inputs_advance", "fused_split_reduce",
                                           "gemv_pdl_mode", "prefill_graph_max_tokens", "gemv_rows_knobs",
                                           "gemv_block_knobs", "fused_mlp_knobs", "triton_decode"))
    assert plan["gemv_rows"] == "off" and figures["decode_tiling"] == "" and figures["prefill_graph_tokens"] == []
    assert plan["copy_stream"] == 0  # the most rows a step copies out on the side stream: none on a CPU
    timing = figures["step_timing"]
    assert timing["overlapped_steps"] > 0 and timing["steps"] >= 5


def test_a_kernel_option_the_cpu_cannot_serve_is_a_clear_error():
    proc = run_tool("--num-prompts", "1", "--input-len", "4", "--output-len", "2", "--kernel-options", "fused-greedy=on")
    assert proc.returncode != 0
    assert "--kernel-options fused-greedy=on needs a CUDA device" in proc.stderr and "TRITON_INTERPRET=1" in proc.stderr


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
