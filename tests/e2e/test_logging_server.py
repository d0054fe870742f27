"""Logs of a real server, read from its stderr: JSON lines that stay whole under load, request
logs that follow one request id through the four processes, the access log's statuses, the
scheduler's decode line every --decode-log-interval steps, and no API key anywhere.

One server for the module: ``--log-json --log-requests --log-requests-level 3`` (everything, so
that request lines carry whole prompts and token ids and exceed PIPE_BUF), an API key, and a
decode line every 5 decode steps. The tests read the lines it has printed so far, in order.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from server import ServerProcess, wait_until

MODEL = "tiny-llama-v1"
API_KEY = "sk-logtest-0123456789abcdef"
DECODE_INTERVAL = 5
PIPE_BUF = 4096
BASE_KEYS = {"event", "level", "timestamp", "actor", "pid"}
# Keys every line of these events has (docs/logging.md lists them, and the optional ones).
REQUIRED = {
    "http": {"logger", "method", "path", "status", "bytes", "duration_ms", "rid", "client", "completed"},
    "request arrived": {"rid", "stream", "priority", "sampling"},
    "request tokenized": {"rid", "prompt_tokens", "tokenize_ms", "input_ids"},
    "request admitted": {"rid", "queue_ms", "prompt_tokens", "cached_tokens", "times_retracted"},
    "request first token": {"rid", "ttft_ms"},
    "request detokenized": {"rid", "finish_reason", "completion_tokens"},
    "request finished": {"rid", "finish_reason", "status", "e2e_ms"},
    "Prefill batch": {"new_seq", "new_token", "cached_token", "cache_hit_rate", "token_usage", "kv_tokens",
                      "running_req", "queue_req"},
    "Decode batch": {"decode_steps", "token_usage", "kv_tokens", "running_req", "queue_req", "gen_throughput"},
}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(cache_dir):
    process = ServerProcess(
        "--log-json", "--log-requests", "--log-requests-level", "3", "--api-key", API_KEY,
        "--decode-log-interval", str(DECODE_INTERVAL), "--http-read-timeout", "1",
        cache_dir=cache_dir, tail_lines=1_000_000,
    )
    try:
        process.wait_serving()
        yield process
    finally:
        process.stop()


def parsed(server: ServerProcess) -> list[dict[str, Any]]:
    """Every line printed so far, as JSON (a line that is not fails the test, naming it)."""
    lines = []
    for line in list(server.lines):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON line: {line[:300]!r}")
        assert isinstance(value, dict), line[:300]
        lines.append(value)
    return lines


def completion(url: str, prompt: str, rid: str, *, max_tokens: int, stream: bool) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    with httpx.Client(timeout=120) as http, http.stream(
        "POST", f"{url}/v1/completions", json=body, headers={**AUTH, "X-Request-Id": rid},
    ) as response:
        raw = response.read().decode()
    return response.status_code, raw


def access_line(server: ServerProcess, rid: str) -> dict[str, Any] | None:
    lines = [line for line in parsed(server) if line["event"] == "http" and line["rid"] == rid]
    return lines[-1] if lines else None


def test_every_line_is_whole_json_with_its_keys_under_concurrent_load(server):
    prompts = {f"load-{i}": f"request {i} asks: " + "The quick brown fox jumps over the lazy dog. " * 100
               for i in range(16)}
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda rid: completion(server.url, prompts[rid], rid, max_tokens=24, stream=True),
                                prompts))
    assert [status for status, _ in answers] == [200] * 16, [raw[:300] for _, raw in answers]
    assert wait_until(lambda: all(access_line(server, rid) for rid in prompts), timeout=10)
    lines = parsed(server)
    for line in lines:
        assert BASE_KEYS <= line.keys(), line
        assert line["actor"].startswith("app::") and isinstance(line["pid"], int), line
        missing = REQUIRED.get(line["event"], set()) - line.keys()
        assert not missing, (missing, line)
    # Level 3: each arrival holds its whole prompt, exactly as sent (no line cut or mixed with another)
    arrivals = {line["rid"]: line for line in lines if line["event"] == "request arrived"}
    for rid, prompt in prompts.items():
        assert arrivals[rid]["prompt"] == prompt
        assert arrivals[rid]["sampling"]["max_new_tokens"] == 24
    long_lines = [line for line in server.lines if len(line.encode()) > PIPE_BUF]
    assert len(long_lines) >= 32, len(long_lines)  # arrivals and tokenizations, from two processes
    actors_of_long = {json.loads(line)["actor"] for line in long_lines}
    assert {"app::ingress", "app::tokenizer"} <= actors_of_long
    finishes = {line["rid"]: line for line in lines if line["event"] == "request finished"
                and line["actor"] == "app::scheduler_TP0"}
    for rid in prompts:
        assert finishes[rid]["completion_tokens"] == 24 and len(finishes[rid]["output_ids"]) == 24
        assert finishes[rid]["finish_reason"] == "length" and finishes[rid]["status"] == 200
        assert 0 <= finishes[rid]["queue_ms"] <= finishes[rid]["ttft_ms"] <= finishes[rid]["e2e_ms"]


def test_one_request_id_is_the_rid_of_its_lines_in_every_actor(server):
    rid = "trace-me-7f3a"
    status, _ = completion(server.url, "Follow this request", rid, max_tokens=6, stream=False)
    assert status == 200
    assert wait_until(lambda: access_line(server, rid) is not None, timeout=10)
    mine = [line for line in parsed(server) if line.get("rid") == rid]
    by_actor: dict[str, list[str]] = {}
    for line in mine:
        by_actor.setdefault(line["actor"], []).append(line["event"])
    assert by_actor["app::ingress"] == ["request arrived", "request finished", "http"], by_actor
    assert by_actor["app::tokenizer"] == ["request tokenized"], by_actor
    assert by_actor["app::scheduler_TP0"] == ["request admitted", "request first token", "request finished"], by_actor
    assert by_actor["app::detokenizer"] == ["request detokenized"], by_actor
    finish = next(line for line in mine if line["event"] == "request finished" and line["actor"] == "app::ingress")
    assert finish["status"] == 200 and finish["completion_tokens"] == 6 and finish["finish_reason"] == "length"
    assert finish["prompt_tokens"] == next(line for line in mine if line["event"] == "request tokenized")["prompt_tokens"]
    # The text the client got is the output logged (level 3: whole)
    assert isinstance(finish["output"], str)


def test_access_lines_carry_the_status_and_never_the_key_or_query(server):
    url = server.url
    cases = {
        "status-200": (200, lambda h: httpx.post(f"{url}/v1/completions?api_key={API_KEY}", headers=h,
                                                 json={"model": MODEL, "prompt": "hi", "max_tokens": 2})),
        "status-400": (400, lambda h: httpx.post(f"{url}/v1/completions", headers=h,
                                                 json={"model": MODEL, "prompt": "hi", "max_tokens": -1})),
        "status-401": (401, lambda h: httpx.get(f"{url}/v1/models", headers={"X-Request-Id": h["X-Request-Id"]})),
        "status-404": (404, lambda h: httpx.get(f"{url}/no/such/route", headers=h)),
    }
    for rid, (expected, call) in cases.items():
        response = call({**AUTH, "X-Request-Id": rid})
        assert response.status_code == expected, response.text
        assert response.headers["x-request-id"] == rid
    assert wait_until(lambda: all(access_line(server, rid) for rid in cases), timeout=10)
    for rid, (expected, _) in cases.items():
        line = access_line(server, rid)
        assert line["status"] == expected and line["completed"] is True, line
        assert line["bytes"] > 0 and line["duration_ms"] >= 0 and line["client"].startswith("127.0.0.1:"), line
        assert line["method"] in ("GET", "POST") and "?" not in line["path"], line
    assert access_line(server, "status-200")["path"] == "/v1/completions"
    assert access_line(server, "status-404")["path"] == "/no/such/route"


def test_a_body_too_slow_gets_an_access_line_with_408(server):
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\nx-request-id: slow-body\r\n\r\n{")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert wait_until(lambda: access_line(server, "slow-body") is not None, timeout=10)
    line = access_line(server, "slow-body")
    assert line["status"] == 408 and line["method"] == "POST" and line["duration_ms"] >= 1000, line


def test_the_api_key_appears_nowhere_in_the_output(server):
    status, _ = completion(server.url, "A request with the key", "key-check", max_tokens=3, stream=True)
    assert status == 200
    assert wait_until(lambda: access_line(server, "key-check") is not None, timeout=10)
    output = server.log()
    assert "key-check" in output and "request arrived" in output
    assert API_KEY not in output
    assert "logtest-0123456789" not in output  # not even a piece of it
    assert "authorization" not in output.lower()


def test_the_decode_line_comes_every_interval_of_decode_steps(server):
    before = len(server.lines)
    steps = 4 * DECODE_INTERVAL  # decode steps of the request: its first token comes from the prefill
    status, _ = completion(server.url, "Decode alone", "decode-alone", max_tokens=steps + 1, stream=False)
    assert status == 200
    assert wait_until(lambda: access_line(server, "decode-alone") is not None, timeout=10)
    time.sleep(0.2)
    lines = parsed(server)
    decodes = [line for line in lines if line["event"] == "Decode batch"]
    assert decodes, "no Decode batch line"
    numbers = [line["decode_steps"] for line in decodes]
    assert all(n % DECODE_INTERVAL == 0 for n in numbers), numbers
    assert numbers == list(range(DECODE_INTERVAL, DECODE_INTERVAL * (len(numbers) + 1), DECODE_INTERVAL)), numbers
    # The lone request ran ``steps`` decode steps: exactly steps / interval lines
    mine = [line for line in lines[before:] if line["actor"] == "app::scheduler_TP0"]
    first = next(i for i, line in enumerate(mine) if line.get("rid") == "decode-alone" and line["event"] == "request first token")
    during = [line for line in mine[first:] if line["event"] == "Decode batch"]
    assert len(during) == steps // DECODE_INTERVAL, during
    for line in during:
        # the last step's line comes after the request left (running 0)
        assert line["running_req"] in (0, 1) and line["queue_req"] == 0 and line["gen_throughput"] > 0, line
        assert 0 <= line["token_usage"] < 1 and line["kv_tokens"] >= 0, line
