"""tools/bench_serving.py as a real subprocess against real servers with the embedded tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server import alive, children_of, reap, tool_args_with_shared_gpu_pool, wait_until

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num-prompts", "12", "--random-input-len", "16", "--random-output-len", "8"]


def bench(*args: str, cache_dir: Path | None = None) -> tuple[dict, subprocess.CompletedProcess]:
    """Run the tool; its report (the last stdout line) and the finished process."""
    env = dict(os.environ, **({"APP_CACHE_DIR": str(cache_dir)} if cache_dir else {}))
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_serving.py"),
                             *tool_args_with_shared_gpu_pool(args)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result


def app_processes_among(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are one of our servers or actors and still run."""
    found = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (b"app::" in cmdline or b"app\0serve" in cmdline) and alive(pid):
            found.append(pid)
    return found


def assert_nothing_left_since(before: set[int]) -> None:
    """ServerProcess stopped the server and its actors (orphans would be re-parented to us)."""
    left = app_processes_among([pid for pid in children_of(os.getpid()) if pid not in before])
    for pid in left:
        wait_until(lambda: not alive(pid), timeout=5)  # noqa: B023
        reap(pid)
    assert not left, f"processes left behind: {left}"


def assert_latency(figures: dict) -> None:
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        stats = figures[key]
        assert stats["mean"] > 0 and 0 < stats["p50"] <= stats["p99"], (key, stats)
    assert figures["itl_ms"]["p50"] < figures["e2e_ms"]["p50"]


def test_two_rates_against_a_launched_server_count_every_token_and_leave_nothing(cache_dir, tmp_path):
    before = set(children_of(os.getpid()))
    out = tmp_path / "report.json"
    report, result = bench(*SMALL, "--request-rate", "20", "inf", "--max-concurrency", "4",
                           "--output-json", str(out), cache_dir=cache_dir)
    assert report["launched"] is True and report["model"] == "tiny-llama-v1"
    assert [level["request_rate"] for level in report["levels"]] == [20.0, "inf"]
    for level in report["levels"]:
        assert level["completed"] == 12 and level["errors"] == 0 and level["error_kinds"] == {}
        assert level["total_output_tokens"] == 12 * 8  # ignore_eos: exact
        assert level["total_input_tokens"] == 12 * 16  # token ids: exact
        assert level["request_throughput"] > 0 and level["output_tok_s"] > 0 and level["input_tok_s"] > 0
        assert 1 <= level["max_concurrency_reached"] <= 4
        assert_latency(level)
        # Our server's /server_info has the scheduler's step_timing (null from servers without it).
        assert level["steps"] is None or level["steps"] > 0
        share = level["outside_gpu_share"]
        assert share is None or 0.0 <= share <= 1.0
    # The human table comes right before the JSON; the file holds the same levels and every request.
    lines = result.stdout.strip().splitlines()
    assert lines[-5].split()[:3] == ["rate", "conc", "done"] and lines[-3].split()[0] == "20.0"
    saved = json.loads(out.read_text())
    assert [len(level["requests"]) for level in saved["levels"]] == [12, 12]
    assert {k: v for k, v in saved["levels"][0].items() if k != "requests"} == report["levels"][0]
    assert_nothing_left_since(before)


def test_the_overload_study_counts_503s_as_refusals_with_their_latency(cache_dir, tmp_path):
    before = set(children_of(os.getpid()))
    out = tmp_path / "report.json"
    # 16 requests in flight at once against 2 running + 2 queued: the saturation level is refused some.
    report, result = bench("--overload", "--num-prompts", "16", "--random-input-len", "16",
                           "--random-output-len", "8", "--saturation-concurrency", "16", "--output-json", str(out),
                           "--", "--max-running-requests", "2", "--max-queued-requests", "2", cache_dir=cache_dir)
    levels, study = report["levels"], report["overload"]
    assert [level["phase"] for level in levels] == ["saturation", "unloaded", "overload"]
    assert study["max_queued_requests"] == 2 and study["max_running_requests"] == 2
    assert study["saturation_concurrency"] == 16 and study["saturation_rate"] == levels[0]["request_throughput"] > 0
    assert levels[1]["request_rate"] == study["unloaded_rate"] == pytest.approx(study["saturation_rate"] / 2, abs=1e-3)
    assert levels[2]["request_rate"] == study["overload_rate"] == pytest.approx(study["saturation_rate"] * 2, abs=1e-3)
    saved = json.loads(out.read_text())["levels"]
    for level, detail in zip(levels, saved):
        assert level["errors"] == 0 and level["error_kinds"] == {}  # a 503 is not an error here
        assert level["completed"] + level["refused"] == 16
        assert level["refused_share"] == pytest.approx(level["refused"] / 16, abs=1e-4)
        # Every admitted request's tokens are counted; a refusal's latency is the 503's round trip.
        assert level["total_output_tokens"] == level["completed"] * 8
        assert level["total_input_tokens"] == level["completed"] * 16
        refusals = [r["e2e_s"] for r in detail["requests"] if r["error"] == "http_503"]
        assert len(refusals) == level["refused"] and all(0 < s < 5 for s in refusals)
        if refusals:
            fastest, slowest = 1e3 * min(refusals) - 1e-3, 1e3 * max(refusals) + 1e-3  # ms, rounded
            assert fastest <= level["refusal_ms"]["p50"] <= level["refusal_ms"]["p99"] <= slowest
        else:
            assert level["refusal_ms"]["p99"] is None
    assert levels[0]["refused"] >= 1
    assert study["refused_share"] == levels[2]["refused_share"] and study["refusal_ms"] == levels[2]["refusal_ms"]
    ttft = study["ttft_p99_ms"]
    assert ttft == {"unloaded": levels[1]["ttft_ms"]["p99"], "overload": levels[2]["ttft_ms"]["p99"]}
    assert study["ttft_p99_ratio"] == pytest.approx(ttft["overload"] / ttft["unloaded"], rel=1e-2)
    assert study["ttft_p99_within_2x"] == (study["ttft_p99_ratio"] <= 2.0)
    # The verdicts are printed, and the table has the refusal columns.
    assert "overload study (queue bound 2)" in result.stdout and "within 2x" in result.stdout
    assert result.stdout.strip().splitlines()[-6].split()[:6] == ["phase", "rate", "conc", "done", "err", "refused"]
    assert_nothing_left_since(before)


def test_an_unknown_model_is_an_error_per_request_not_a_crash(shared_server):
    report, result = bench("--base-url", shared_server.url, "--model", "no-such-model", *SMALL,
                           "--request-rate", "inf")
    [level] = report["levels"]
    assert report["launched"] is False
    assert level["completed"] == 0 and level["errors"] == 12
    assert level["error_kinds"] == {"http_404": 12}  # OpenAI's model_not_found
    assert level["ttft_ms"] == {"mean": None, "p50": None, "p99": None}
    assert level["total_output_tokens"] == 0 and level["request_throughput"] == 0
    assert "warm-up request failed: http_404" in result.stdout


def test_a_range_ratio_draws_each_length_within_its_range(shared_server, tmp_path):
    out = tmp_path / "report.json"
    report, _ = bench("--base-url", shared_server.url, *SMALL, "--random-range-ratio", "0.5",
                      "--max-concurrency", "6", "--seed", "7", "--output-json", str(out))
    [level] = report["levels"]
    assert level["completed"] == 12 and level["errors"] == 0
    assert 8 <= level["input_len"]["min"] and level["input_len"]["max"] <= 16
    assert 4 <= level["output_len"]["min"] and level["output_len"]["max"] <= 8
    requests = json.loads(out.read_text())["levels"][0]["requests"]
    inputs = [r["sent_input_len"] for r in requests]
    assert all(8 <= n <= 16 for n in inputs) and len(set(inputs)) > 1
    for r in requests:  # the server counted exactly what was sent and asked for
        assert r["input_tokens"] == r["sent_input_len"] and r["output_tokens"] == r["asked_output_len"]
    assert level["total_input_tokens"] == sum(inputs)


def test_continuous_usage_stats_time_every_token(shared_server, tmp_path):
    out = tmp_path / "report.json"
    report, _ = bench("--base-url", shared_server.url, "--num-prompts", "12", "--random-input-len", "16",
                      "--random-output-len", "24", "--continuous-usage-stats", "--max-concurrency", "4",
                      "--output-json", str(out))
    [level] = report["levels"]
    assert level["completed"] == 12 and level["errors"] == 0
    assert level["total_output_tokens"] == 12 * 24
    for r in json.loads(out.read_text())["levels"][0]["requests"]:
        # Every token had a chunk (those without text too), so each one after the first has its gap.
        assert r["output_tokens"] == r["asked_output_len"] == 24
        assert len(r["itls_s"]) == 24 - 1 and all(gap >= 0 for gap in r["itls_s"])


@pytest.mark.parametrize("flags", [["--random-range-ratio", "1.5"], ["--request-rate", "0"],
                                   ["--base-url", "http://x", "--", "--dtype", "float32"]])
def test_bad_flags_exit_two(flags):
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_serving.py"), *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "error:" in result.stderr


# ---------------------------------------------------------------- client processes, usage, offline

sys.path.insert(0, str(ROOT / "tools"))
from bench_serving import arrival_offsets  # noqa: E402
from loadgen.procs import auto_client_procs, split_level  # noqa: E402
from loadgen.stream import RequestSpec  # noqa: E402

PAD_ID = 1023  # the embedded tokenizer's <|pad|>, a special token: it decodes to no text
ALWAYS_PAD = json.dumps({"logit_bias": {str(PAD_ID): 100}})


def client_processes_among(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are multiprocessing children (client workers, the resource tracker)
    and still run."""
    found = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing" in cmdline and alive(pid):
            found.append(pid)
    return found


def test_a_level_splits_round_robin_with_the_cap_shared_and_the_schedule_kept():
    specs = [RequestSpec([i], 1) for i in range(7)]
    offsets = [0.1 * i for i in range(7)]
    shares = split_level(specs, offsets, 5, 3)
    assert [s.max_concurrency for s in shares] == [2, 2, 1]
    assert sorted((o, s.prompt[0]) for share in shares for s, o in zip(share.specs, share.offsets)) == \
        [(o, s.prompt[0]) for s, o in zip(specs, offsets)]
    assert len(split_level(specs, offsets, 2, 4)) == 2  # no process without a slot
    assert len(split_level(specs[:1], offsets[:1], None, 4)) == 1  # nor without a request
    assert [s.max_concurrency for s in split_level(specs, offsets, None, 2)] == [None, None]
    # auto: one per 64 streams, at most half the cores, at least one.
    assert [auto_client_procs(n, 16) for n in (1, 64, 65, 256, 4096)] == [1, 1, 2, 4, 8]
    assert auto_client_procs(256, 2) == 1 and auto_client_procs(256, 1) == 1


def test_two_client_processes_send_what_one_sends_and_report_their_cpu(shared_server, tmp_path):
    before = set(children_of(os.getpid()))
    flags = [*SMALL, "--request-rate", "20", "inf", "--max-concurrency", "4"]
    one, _ = bench("--base-url", shared_server.url, *flags, "--client-procs", "1")
    out = tmp_path / "report.json"
    two, _ = bench("--base-url", shared_server.url, *flags, "--client-procs", "2", "--output-json", str(out))
    assert one["config"]["client_procs"] == 1 and two["config"]["client_procs"] == 2
    saved = json.loads(out.read_text())["levels"]
    for a, b, detail in zip(one["levels"], two["levels"], saved):
        assert a["completed"] == b["completed"] == 12 and a["errors"] == b["errors"] == 0
        assert a["total_output_tokens"] == b["total_output_tokens"] == 12 * 8
        assert a["total_input_tokens"] == b["total_input_tokens"] == 12 * 16
        assert a["input_len"] == b["input_len"] and a["output_len"] == b["output_len"]  # the same prompts
        assert 1 <= b["max_concurrency_reached"] <= 4  # the cap, split 2 + 2, holds over both processes
        assert_latency(b)
        assert a["client_procs"] == 1 and len(a["client_cpu_s_per_proc"]) == 1
        assert b["client_procs"] == 2 and len(b["client_cpu_s_per_proc"]) == 2
        assert all(cpu > 0 for cpu in b["client_cpu_s_per_proc"])
        assert b["client_cpu_s"] == pytest.approx(sum(b["client_cpu_s_per_proc"]), abs=2e-3)
        # The report's seconds are rounded to milliseconds, the share was computed before: a level
        # of a few hundred milliseconds leaves it a few percent apart.
        assert b["client_cpu_share"] == pytest.approx(b["client_cpu_s"] / (b["duration_s"] * 2), rel=0.02, abs=0.01)
        assert b["client_cpu_share"] <= b["client_cpu_share_max"] + 1e-4
        assert b["client_cpu_share_max"] == pytest.approx(max(b["client_cpu_s_per_proc"]) / b["duration_s"], rel=0.02,
                                                          abs=0.01)
        assert b["client_bound"] == (b["client_cpu_share_max"] > 0.8)
        requests = detail["requests"]
        assert sorted(r["client_proc"] for r in requests) == [0] * 6 + [1] * 6
        assert min(r["sent_at"] for r in requests) == 0
        assert max(r["ended_at"] for r in requests) == pytest.approx(b["duration_s"], abs=2e-3)
        for r in requests:  # one clock for both processes
            assert r["ended_at"] - r["sent_at"] == pytest.approx(r["e2e_s"], abs=1e-5)
    # The rate level kept the parent's Poisson schedule: no request went out before its time
    # (the times count from the first send, which may itself have been a little late).
    sent = sorted(r["sent_at"] for r in saved[0]["requests"])
    assert all(s >= o - 0.05 for s, o in zip(sent, arrival_offsets("arrivals/1/0", 12, 20.0)))
    left = client_processes_among([pid for pid in children_of(os.getpid()) if pid not in before])
    assert not left, f"client processes left behind: {left}"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_run_leaves_no_client_process(shared_server, signum):
    before = set(children_of(os.getpid()))
    tool = subprocess.Popen([sys.executable, str(ROOT / "tools" / "bench_serving.py"), "--base-url", shared_server.url,
                             "--num-prompts", "2000", "--random-input-len", "16", "--random-output-len", "32",
                             "--request-rate", "40", "--client-procs", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: len(client_processes_among(children_of(tool.pid))) >= 2, timeout=30)
        workers = client_processes_among(children_of(tool.pid))
        time.sleep(1.0)  # the level is under way
        assert tool.poll() is None
        os.kill(tool.pid, signum)
        tool.wait(timeout=15)
    finally:
        if tool.poll() is None:
            tool.kill()
            tool.wait()
    # SIGINT: the tool terminates its workers; SIGKILL: the kernel kills them with it
    # (PR_SET_PDEATHSIG), and the resource tracker ends once its pipe closes.
    assert wait_until(lambda: not any(alive(pid) for pid in workers), timeout=10), workers
    orphans = [pid for pid in children_of(os.getpid()) if pid not in before]
    assert wait_until(lambda: not client_processes_among(orphans), timeout=10), client_processes_among(orphans)
    for pid in [*workers, *orphans]:
        reap(pid)


def test_outputs_without_text_are_counted_from_usage_not_errors(shared_server, tmp_path):
    # Every token the embedded model generates here is <|pad|>: the streams carry no text at all.
    body = {"model": "tiny-llama-v1", "prompt": [600] * 16, "max_tokens": 8, "ignore_eos": True,
            "logit_bias": {str(PAD_ID): 100}, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{shared_server.url}/v1/completions", json=body, timeout=30) as response:
        events = [json.loads(line[5:]) for line in response.iter_lines()
                  if line.startswith("data:") and line.strip() != "data: [DONE]"]
    assert all(choice["text"] == "" for event in events for choice in event["choices"])
    assert events[-1]["usage"]["completion_tokens"] == 8
    out = tmp_path / "report.json"
    final, _ = bench("--base-url", shared_server.url, *SMALL, "--extra-body", ALWAYS_PAD, "--output-json", str(out))
    [level] = final["levels"]
    assert level["completed"] == 12 and level["errors"] == 0 and level["error_kinds"] == {}
    assert level["total_output_tokens"] == 12 * 8  # from the final usage
    # Only the final usage, and no text: nothing showed when the first token came.
    assert level["ttft_unknown"] == 12 and level["ttft_ms"]["p50"] is None
    assert all(r["ttft_s"] is None and r["output_tokens"] == 8 for r in json.loads(out.read_text())["levels"][0]["requests"])
    # With usage in every chunk, each token shows as a usage rise: timed though it has no text.
    continuous, _ = bench("--base-url", shared_server.url, *SMALL, "--extra-body", ALWAYS_PAD,
                          "--continuous-usage-stats")
    [level] = continuous["levels"]
    assert level["completed"] == 12 and level["errors"] == 0 and level["ttft_unknown"] == 0
    assert level["total_output_tokens"] == 12 * 8
    assert_latency(level)


def test_the_offline_engine_runs_the_same_workload_and_gives_the_ratio(cache_dir, tmp_path):
    before = set(children_of(os.getpid()))
    out = tmp_path / "report.json"
    report, result = bench(*SMALL, "--request-rate", "inf", "--max-concurrency", "4", "0", "--offline",
                           "--output-json", str(out), "--", "--context-length", "256", "--max-queued-requests", "32",
                           cache_dir=cache_dir)
    runs = report["offline"]["runs"]
    assert [run["max_running_requests"] for run in runs] == [4, None]  # one per distinct cap
    for run in runs:
        assert run["num_prompts"] == 12 and run["input_len"] == 16 and run["output_len"] == 8
        assert run["output_tokens_per_s"] > 0
        command = run["command"]
        # The server's engine flags, none of its serving-only ones.
        assert command[command.index("--context-length") + 1] == "256" and "--max-queued-requests" not in command
    assert runs[0]["command"][runs[0]["command"].index("--max-running-requests") + 1] == "4"
    assert "--max-running-requests" not in runs[1]["command"]
    for level, run in zip(report["levels"], runs):
        assert level["completed"] == 12 and level["total_output_tokens"] == 12 * 8
        assert level["offline_output_tok_s"] == run["output_tokens_per_s"]
        assert level["vs_offline"] == pytest.approx(level["output_tok_s"] / run["output_tokens_per_s"], rel=1e-3)
        assert f"x{level['vs_offline']:,.3f}" in result.stdout
    header = result.stdout.strip().splitlines()[-5]
    assert header.endswith("offline tok/s  vs off")
    saved = json.loads(out.read_text())
    assert saved["offline"] == report["offline"]
    assert [level["vs_offline"] for level in saved["levels"]] == [level["vs_offline"] for level in report["levels"]]
    assert_nothing_left_since(before)
