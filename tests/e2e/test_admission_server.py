"""Limits and admission on a real server: a bounded queue refuses at once with 503 and
Retry-After on every route (streams included, before their first byte), and a request asking
for more than the context is a 400 naming both numbers unless --allow-auto-truncate.

One server for the module: one request decodes at a time and two may wait
(``--max-running-requests 1 --max-queued-requests 2``), context 256.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server import serving, wait_until

MODEL = "tiny-llama-v1"
CONTEXT = 256
LONG = 200  # tokens an admitted request generates: it keeps the queue busy for a while
QUEUE_FULL = "The request queue is full."


@pytest.fixture(scope="module")
def url(cache_dir):
    with serving("--context-length", str(CONTEXT), "--max-total-tokens", "4096",
                 "--max-running-requests", "1", "--max-queued-requests", "2", cache_dir=cache_dir) as served:
        yield served


def completion(url: str, *, stream: bool, prompt: str = "The queue", max_tokens: int = LONG) -> dict:
    """POST /v1/completions; status, Retry-After, seconds taken, the text and the finish."""
    started = time.monotonic()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
        raw = response.read().decode()
    taken = time.monotonic() - started
    result = {"status": response.status_code, "retry_after": response.headers.get("retry-after"), "s": taken,
              "content_type": response.headers.get("content-type", "")}
    if response.status_code != 200:
        result["error"] = json.loads(raw)
    elif stream:
        chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        result["text"] = "".join(c["choices"][0]["text"] for c in chunks)
        result["finish"] = chunks[-1]["choices"][0]["finish_reason"]
    else:
        answer = json.loads(raw)
        result["text"], result["finish"] = answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]
    return result


def assert_queue_full(status: int, headers: httpx.Headers, body: dict) -> None:
    assert status == 503, body
    assert headers.get("retry-after") == "1"
    assert headers.get("content-type", "").startswith("application/json")  # not an SSE stream
    assert body["message"] == QUEUE_FULL and body["code"] == 503 and body["object"] == "error"


def queue_drained(url: str) -> bool:
    info = httpx.get(f"{url}/server_info").json()["scheduler"]
    return info["running_requests"] == 0 and info["queued_requests"] == 0 and info["kv_pool"]["used"] == 0


def test_a_burst_past_the_queue_is_refused_at_once_and_the_admitted_are_answered_whole(url):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: completion(url, stream=i % 2 == 1), range(8)))
    admitted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] != 200]
    # one decoding and two waiting at most: the third arrival was refused whenever it came
    assert 2 <= len(admitted) <= 3, results
    for r in refused:
        assert r["status"] == 503 and r["retry_after"] == "1" and r["error"]["message"] == QUEUE_FULL, r
    assert max(r["s"] for r in refused) < min(r["s"] for r in admitted), results  # refusals never waited
    reference = completion(url, stream=False)
    assert reference["finish"] == "length" and reference["text"]
    for r in admitted:
        assert (r["text"], r["finish"]) == (reference["text"], "length")
    assert wait_until(lambda: queue_drained(url), timeout=10, interval=0.1)


def test_every_route_answers_a_full_queue_with_503_before_any_stream_starts(url):
    statuses: list[int] = []
    occupants = [threading.Thread(target=lambda: statuses.append(completion(url, stream=False)["status"]))
                 for _ in range(3)]
    for thread in occupants:
        thread.start()
        time.sleep(0.05)  # in order: the first decodes, the other two wait

    def full() -> bool:
        info = httpx.get(f"{url}/server_info").json()["scheduler"]
        return info["queued_requests"] == 2

    try:
        assert wait_until(full, timeout=20, interval=0.02)
        gate_before = httpx.get(f"{url}/server_info").json()["queue_gate"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        attempts = [
            ("/v1/chat/completions", chat | {"stream": True}),
            ("/v1/chat/completions", chat),
            ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}),
            ("/generate", {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 4}}),
            ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}}),
        ]
        with httpx.Client(timeout=30) as http:
            for path, body in attempts:
                with http.stream("POST", f"{url}{path}", json=body) as response:
                    payload = json.loads(response.read())
                assert_queue_full(response.status_code, response.headers, payload)
        # one running and two waiting are three unfinished, the gate's bound: the ingress refused
        # all five itself, without a trip through the actors
        gate = httpx.get(f"{url}/server_info").json()["queue_gate"]
        assert gate["bound"] == 3
        assert gate["refused"] - gate_before["refused"] == len(attempts)
    finally:
        for thread in occupants:
            thread.join(timeout=60)
    assert statuses == [200, 200, 200]
    assert wait_until(lambda: queue_drained(url), timeout=10, interval=0.1)


@pytest.mark.parametrize(("path", "body", "param", "asked"), [
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 100000}, "max_tokens", 100000),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 300}, "max_completion_tokens", 300),
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 254}},
     "sampling_params.max_new_tokens", 254),
])
def test_asking_past_the_context_is_a_400_naming_both_numbers(url, path, body, param, asked):
    response = httpx.post(f"{url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["param"] == param
    message = error["message"]
    assert message.startswith(f"This model's maximum context length is {CONTEXT} tokens. However, you requested ")
    prompt = int(message.split("(")[1].split(" in the prompt")[0])
    assert f"you requested {prompt + asked} tokens ({prompt} in the prompt, {asked} for the completion)" in message
    if path != "/v1/chat/completions":
        assert prompt == 3


def test_without_max_tokens_a_request_runs_to_the_context(url):
    response = httpx.post(f"{url}/v1/completions", json={
        "model": MODEL, "prompt": [1, 2, 3], "max_tokens": None, "temperature": 0, "ignore_eos": True}, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] == CONTEXT


def test_allow_auto_truncate_cuts_at_the_context_instead(start_server):
    server = start_server("--context-length", "64", "--max-total-tokens", "1024", "--allow-auto-truncate")
    response = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 100000, "temperature": 0, "ignore_eos": True}, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (3, 61)
