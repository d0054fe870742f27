"""tools/bench_serving.py as a real subprocess against real servers with the embedded tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
