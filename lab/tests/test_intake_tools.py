"""lab/tools/bench_intake.py and lab/tools/bench_sse.py as their users run them: real subprocesses
(a real server, or hypercorn over a stand-in backend), their JSON reports checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from app.server_process import children_of

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One embedded-model cache for the module (built once, by the first server)."""
    return tmp_path_factory.mktemp("app-cache")


def run_tool(name: str, *args: str, cache_dir: Path) -> dict:
    env = dict(os.environ, APP_CACHE_DIR=str(cache_dir))
    result = subprocess.run([sys.executable, str(ROOT / "lab" / "tools" / name), *args],
                            capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_bench_intake_traces_every_request_through_every_actor(cache_dir, tmp_path):
    before = set(children_of(os.getpid()))
    traces_before = set(Path(tempfile.gettempdir()).glob("bench-intake-*"))
    flags = ("--num-requests", "6", "--input-len", "24", "--rounds", "1", "--max-tokens", "0", "3",
             "--output-json", str(tmp_path / "intake.json"))
    report = run_tool("bench_intake.py", *flags, cache_dir=cache_dir)
    assert json.loads((tmp_path / "intake.json").read_text()) == report
    rounds = report["rounds"]
    assert [(r["max_tokens"], r["mode"]) for r in rounds] == [(0, "plain"), (0, "stream"), (3, "plain"), (3, "stream")]
    for figures in rounds:
        assert figures["requests"] == 6 and figures["errors"] == {}
        assert 0 < figures["latency_ms"]["p50"] <= figures["latency_ms"]["max"] <= figures["burst_ms"]
        assert {stage["n"] for stage in figures["stages"].values()} == {6}  # every mark of every request
        arrivals = figures["arrivals"]
        assert arrivals["http.request"]["first"] <= arrivals["scheduler.add"]["first"] <= arrivals["client.end"]["first"]
        assert set(figures["cpu_s"]) == {"ingress", "tokenizer", "scheduler_TP0", "detokenizer", "client"}
        assert figures["steps"] >= 1 and figures["floor_ms"] > 0
    assert set(children_of(os.getpid())) - before == set()  # the server and its actors are gone
    assert set(Path(tempfile.gettempdir()).glob("bench-intake-*")) <= traces_before  # its trace files removed


def test_bench_sse_streams_every_token_of_every_stream(cache_dir):
    report = run_tool("bench_sse.py", "--streams", "6", "--tokens", "5", "--step-ms", "1", "--rounds", "1",
                      cache_dir=cache_dir)
    [level] = report["levels"]
    assert level["errors"] == 0 and level["streams"] == 6 and level["tokens"] == 5
    assert level["burst_ms"] > 0 and level["server_cpu_s"] >= 0
