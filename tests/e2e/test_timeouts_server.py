"""Request timeouts through a real server with one running slot: a long request holds the slot
until its request timeout ends it mid-decode, while a second one expires in the queue; both get
503 with an OpenAI-shaped body naming the timeout (a started stream: an SSE error event, then
[DONE]), and the KV pool is all free afterwards.

The server's flags cover the non-streaming case (--waiting-timeout 0.5, --request-timeout 1.5);
the streaming case sets shorter per-request values (``timeout``, ``waiting_timeout``)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server import become_subreaper, serving, wait_until

MODEL = "tiny-llama-v1"
# A decode far longer than any timeout below (thousands of steps): it ends only by its timeout.
LONG = {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def url(cache_dir):
    become_subreaper()
    with serving("--max-running-requests", "1", "--max-total-tokens", "8192",
                 "--waiting-timeout", "0.5", "--request-timeout", "1.5", cache_dir=cache_dir) as served:
        yield served


def scheduler_info(url: str) -> dict:
    return httpx.get(f"{url}/server_info").json()["scheduler"]


def wait_running(url: str) -> None:
    assert wait_until(lambda: scheduler_info(url)["running_requests"] == 1, timeout=10, interval=0.02)


def assert_pool_free(url: str) -> None:
    """Nothing held by a request: only the prefix cache may keep (evictable) tokens."""

    def clean() -> bool:
        info = scheduler_info(url)
        pool = info["kv_pool"]
        return (info["running_requests"] == 0 and info["queued_requests"] == 0 and pool["used"] == 0
                and pool["locked"] == 0 and pool["free"] + pool["evictable"] == pool["total"])

    assert wait_until(clean, timeout=10, interval=0.1), scheduler_info(url)


def assert_timeout_error(body: dict, message: str) -> None:
    assert body == {"object": "error", "message": message, "type": "ServiceUnavailableError", "param": None, "code": 503}


def test_the_servers_timeouts_answer_503_in_the_queue_and_while_decoding(url):
    info = scheduler_info(url)
    assert (info["waiting_timeout_s"], info["request_timeout_s"]) == (0.5, 1.5)  # /server_info reports them
    with ThreadPoolExecutor(2) as pool, httpx.Client(timeout=30) as http:
        started = time.monotonic()
        holder = pool.submit(http.post, f"{url}/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": LONG})
        wait_running(url)
        queued = http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
        waited = time.monotonic() - started
        held = holder.result()
        held_for = time.monotonic() - started

    assert queued.status_code == 503
    assert_timeout_error(queued.json(), "the request waited longer than the waiting timeout (0.5 s)")
    assert 0.5 <= waited < 1.5  # expired in the queue, before the slot came free
    assert held.status_code == 503
    assert_timeout_error(held.json(), "the request took longer than the request timeout (1.5 s)")
    assert 1.5 <= held_for < 5.0
    assert_pool_free(url)


def test_a_requests_own_timeouts_end_a_started_stream_with_an_error_event_and_a_queued_one_with_503(url):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "stream": True,
            "max_tokens": 4000, "ignore_eos": True, "temperature": 0, "timeout": 1.0}
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=30) as http:

        def stream_chat() -> list[str]:
            with http.stream("POST", f"{url}/v1/chat/completions", json=chat) as response:
                assert response.status_code == 200
                return [line for line in response.iter_lines() if line]

        streamed = pool.submit(stream_chat)
        wait_running(url)
        queued = http.post(f"{url}/generate", json={"text": "hi", "stream": True, "sampling_params": LONG,
                                                    "waiting_timeout": 0.2})
        lines = streamed.result()

    assert queued.status_code == 503  # nothing was streamed yet: the status says it
    assert_timeout_error(queued.json(), "the request waited longer than the waiting timeout (0.2 s)")
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))
    assert error == {"error": {"message": "the request took longer than the request timeout (1.0 s)",
                               "type": "ServiceUnavailableError", "code": 503}}
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-2]]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content  # tokens came before the timeout ended it
    assert_pool_free(url)


def test_a_timeout_out_of_range_is_a_400_naming_the_field(url):
    response = httpx.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"timeout": 0}})
    assert response.status_code == 400
    assert response.json()["param"] == "sampling_params.timeout"
