"""Priority scheduling on a real server: queued requests run in priority-then-arrival order, a
full queue refuses a less important arrival (503) and evicts its least important request for a
more important one (503, SGLang's message), on /generate and the OpenAI routes alike.

One server for the module: one request decodes at a time and three may wait
(``--max-running-requests 1 --max-queued-requests 3 --enable-priority-scheduling``).
Each test first fills the running slot with an occupant, so that what follows queues.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from server import serving, wait_until

MODEL = "tiny-llama-v1"
CONTEXT = 1024
OCCUPANT_TOKENS = 1000  # the running request's length: it holds the slot until the test aborts it
QUEUE_FULL = "The request queue is full."
EVICTED = "The request is aborted by a higher priority request."


@pytest.fixture(scope="module")
def url(cache_dir):
    with serving("--context-length", str(CONTEXT), "--max-total-tokens", "4096", "--max-running-requests", "1",
                 "--max-queued-requests", "3", "--enable-priority-scheduling", cache_dir=cache_dir) as served:
        yield served


def scheduler_figures(url: str) -> dict:
    return httpx.get(f"{url}/server_info", timeout=10).json()["scheduler"]


def generate(url: str, priority: int, max_new_tokens: int = 4, rid: str | None = None) -> httpx.Response:
    body = {"input_ids": [1, 2, 3], "priority": priority,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    if rid is not None:
        body["rid"] = rid
    return httpx.post(f"{url}/generate", json=body, timeout=120)


class Requests:
    """Requests sent from threads, one at a time, each queued before the next is sent."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.responses: dict[str, httpx.Response] = {}
        self.threads: list[threading.Thread] = []

    def send(self, name: str, call: Callable[[], httpx.Response], *, queued: int | None = None,
             running: int | None = None) -> None:
        """Send ``call`` as ``name``; wait until the scheduler shows ``queued`` waiting (and
        ``running`` decoding) requests."""
        thread = threading.Thread(target=lambda: self.responses.__setitem__(name, call()))
        thread.start()
        self.threads.append(thread)

        def settled() -> bool:
            figures = scheduler_figures(self.url)
            return ((queued is None or figures["queued_requests"] == queued)
                    and (running is None or figures["running_requests"] == running))

        figures = scheduler_figures(self.url)
        assert wait_until(settled, timeout=30, interval=0.02), (name, {k: v for k, v in figures.items() if "requests" in k}, self.responses)

    def join(self) -> dict[str, httpx.Response]:
        for thread in self.threads:
            thread.join(timeout=120)
        return self.responses


@contextmanager
def occupied(url: str) -> Iterator[Requests]:
    """A Requests whose first request decodes OCCUPANT_TOKENS tokens (priority 0) until the
    block ends, when it is aborted and the queue moves on; afterwards every request has ended
    and the pool is free."""
    requests = Requests(url)
    requests.send("occupant", lambda: generate(url, 0, OCCUPANT_TOKENS, rid="occupant"), queued=0, running=1)
    try:
        yield requests
    finally:
        httpx.post(f"{url}/abort_request", json={"rid": "occupant"}, timeout=10)
        requests.join()

        def drained() -> bool:
            figures = scheduler_figures(url)
            return (figures["running_requests"], figures["queued_requests"], figures["kv_pool"]["used"]) == (0, 0, 0)

        assert wait_until(drained, timeout=30, interval=0.1), scheduler_figures(url)


def test_queued_requests_complete_in_priority_then_arrival_order(url):
    with occupied(url) as requests:
        for queued, (name, priority) in enumerate((("a", 0), ("b", 5), ("c", 0)), start=1):
            requests.send(name, lambda p=priority: generate(url, p), queued=queued)
    responses = requests.join()
    assert {name: responses[name].status_code for name in "abc"} == dict.fromkeys("abc", 200)
    finished_at = {name: responses[name].json()["meta_info"]["produced_at"] for name in "abc"}
    assert sorted("abc", key=finished_at.__getitem__) == ["b", "a", "c"]  # larger values first, then arrival
    figures = scheduler_figures(url)
    # Queued requests waited their turn: none was important enough to preempt the running one.
    assert (figures["priority_scheduling"], figures["schedule_policy"], figures["preemptions"]) == (True, "fcfs", 0)


def test_a_full_queue_refuses_the_less_important_and_evicts_for_the_more_important(url):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with occupied(url) as requests:
        for queued, (name, priority) in enumerate((("low-old", -1), ("low-new", -1), ("mid", 0)), start=1):
            requests.send(name, lambda p=priority: generate(url, p), queued=queued)
        refused = generate(url, -1)  # no more important than the least: the arrival is refused
        assert refused.status_code == 503 and refused.json()["message"] == QUEUE_FULL
        assert refused.headers.get("retry-after") == "1"
        started = time.monotonic()
        requests.send("chat-high", lambda: httpx.post(f"{url}/v1/chat/completions", json=chat | {"priority": 9},
                                                      timeout=120), queued=3)
        assert wait_until(lambda: "low-new" in requests.responses, timeout=10, interval=0.01)
        assert time.monotonic() - started < 5  # the evicted request is answered at once, not when the queue moves
    responses = requests.join()
    evicted = responses["low-new"]  # ties: the newest of the least important goes
    assert evicted.status_code == 503 and evicted.json()["message"] == EVICTED
    assert {name: responses[name].status_code for name in ("low-old", "mid", "chat-high")} == \
        dict.fromkeys(("low-old", "mid", "chat-high"), 200)
    assert responses["chat-high"].json()["choices"][0]["finish_reason"] == "length"
