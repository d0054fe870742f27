"""A burst of requests through a real server, and the tools that measure it (bench_intake.py,
bench_sse.py) as real subprocesses."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import trio

from server import children_of, tool_args_with_shared_gpu_pool

ROOT = Path(__file__).resolve().parents[2]
BURST = 128  # more than hypercorn's default listen backlog (100)


async def burst(url: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, dict]]:
    """Every prompt at once, each on its own new connection; odd ones streamed. (status, usage)."""
    answers: list[tuple[int, dict]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one(i: int) -> None:
            body = {"model": "tiny-llama-v1", "prompt": prompts[i], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0}
            if i % 2:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                response = await client.post("/v1/completions", json=body)
                chunks = [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: {")]
                assert response.text.endswith("data: [DONE]\n\n"), response.text[-200:]
                finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
                assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
                answers.append((response.status_code, chunks[-1]["usage"]))
            else:
                response = await client.post("/v1/completions", json=body)
                answers.append((response.status_code, response.json()["usage"]))

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    return answers


def test_a_burst_of_token_id_prompts_is_all_answered_with_exact_usage(start_server):
    server = start_server("--max-total-tokens", "16384")
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 1024) for _ in range(rng.randrange(256, 513))] for _ in range(BURST)]
    for max_tokens in (0, 2):  # 0: finished by the scheduler at once; 2: prefill and a decode step
        answers = trio.run(burst, server.url, prompts, max_tokens)
        assert len(answers) == BURST
        assert all(status == 200 for status, _ in answers), [a for a in answers if a[0] != 200][:3]
        assert sorted(usage["prompt_tokens"] for _, usage in answers) == sorted(len(p) for p in prompts)
        assert {usage["completion_tokens"] for _, usage in answers} == {max_tokens}
    info = httpx.get(f"{server.url}/server_info", timeout=30).json()
    assert info["requests_in_flight"] == 0 and info["scheduler"]["running_requests"] == 0
    assert "Traceback" not in server.log()


def run_tool(name: str, *args: str, cache_dir: Path) -> dict:
    env = dict(os.environ, APP_CACHE_DIR=str(cache_dir))
    result = subprocess.run([sys.executable, str(ROOT / "tools" / name), *args],
                            capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_bench_intake_traces_every_request_through_every_actor(cache_dir, tmp_path):
    before = set(children_of(os.getpid()))
    traces_before = set(Path(tempfile.gettempdir()).glob("bench-intake-*"))
    flags = ("--num-requests", "6", "--input-len", "24", "--rounds", "1", "--max-tokens", "0", "3",
             "--output-json", str(tmp_path / "intake.json"))
    report = run_tool("bench_intake.py", *tool_args_with_shared_gpu_pool(flags), cache_dir=cache_dir)
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
