"""``--ingress-workers 2``: two HTTP fronts share the port, each with its own tokenizer and
detokenizer; the one scheduler sends each request's outputs down the lane it came from. Checked
with real clients: both fronts serve, every answer is whole and right, /metrics adds both fronts
up, a SIGTERM drains both, and a scheduler's death answers the clients of both and leaves nothing."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server import alive, reap, stream_in_thread, wait_until

MODEL = "tiny-llama-v1"
CONNECTIONS = 24


def _fronts_whose_lines(server, *words: str) -> set[str]:  # noqa: ANN001 - the ServerProcess fixture's
    """The processes (``app::ingress``...) that logged a line holding every one of ``words``."""
    return {line.split()[2].split("[")[0] for line in list(server.lines) if all(word in line for word in words)}


def _streams_on_fresh_connections(url: str, count: int, max_tokens: int) -> list[tuple[list[str], threading.Event]]:
    """``count`` streamed completions at once, each on a connection of its own (so the kernel
    spreads them over the fronts), with X-Request-Id ``two-fronts-<i>``."""
    streams = [([], threading.Event()) for _ in range(count)]
    for i, (events, started) in enumerate(streams):
        stream_in_thread(url, {"model": MODEL, "prompt": "two fronts", "max_tokens": max_tokens, "stream": True,
                               "ignore_eos": True, "stream_options": {"include_usage": True}}, events, started,
                         headers={"x-request-id": f"two-fronts-{i}"})
    return streams


def _all_gone(actors: dict[str, int]) -> None:
    for name, pid in actors.items():
        assert wait_until(lambda: not alive(pid), timeout=10), f"{name} outlived the server"
        reap(pid)


def test_two_fronts_serve_whole_answers_and_metrics_add_up(start_server):
    server = start_server("--ingress-workers", "2", "--enable-metrics", "--context-length", "1024")
    assert {"ingress_1", "tokenizer_1", "detokenizer_1"} <= set(server.actor_pids())
    streams = _streams_on_fresh_connections(server.url, CONNECTIONS, 24)
    assert wait_until(lambda: all(len(events) and events[-1] != "" and events[-1] == "[DONE]"
                                  for events, _ in streams), timeout=60)
    for events, _ in streams:
        assert not any(event.startswith("transport error") for event in events), events
        chunks = [json.loads(event) for event in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 24
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert _fronts_whose_lines(server, "logger=access", "/v1/completions", "status=200") == {
        "app::ingress", "app::ingress_1"}
    # /metrics from either front (the kernel picks): both fronts' requests, each series once
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        requests = {s.labels["finish_reason"]: s.value for s in families["app:num_requests"].samples
                    if s.name == "app:num_requests_total"}
        if requests.get("length") == CONNECTIONS or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert requests["length"] == CONNECTIONS, requests
    series = [(s.name, tuple(sorted(s.labels.items()))) for f in families.values() for s in f.samples]
    assert len(series) == len(set(series)), "a series appears twice"
    generated = [s.value for s in families["app:generation_tokens"].samples if s.name == "app:generation_tokens_total"]
    assert generated == [CONNECTIONS * 24]


def test_sigterm_drains_both_fronts_and_exits_zero(start_server):
    server = start_server("--ingress-workers", "2", "--shutdown-timeout", "30", "--context-length", "1024")
    actors = server.actor_pids()
    streams = _streams_on_fresh_connections(server.url, 8, 300)
    assert all(started.wait(30) for _, started in streams)
    server.signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0, server.log()
    for events, _ in streams:
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 300, events[-2:]
    _all_gone(actors)


def test_a_scheduler_death_answers_the_clients_of_both_fronts(start_server):
    server = start_server("--ingress-workers", "2", "--context-length", "1024", "--log-requests")
    actors = server.actor_pids()
    streams = _streams_on_fresh_connections(server.url, 8, 900)
    assert all(started.wait(30) for _, started in streams)
    assert _fronts_whose_lines(server, "request arrived", "two-fronts") == {"app::ingress", "app::ingress_1"}
    os.kill(actors["scheduler_TP0"], signal.SIGKILL)
    assert server.wait(timeout=30) == 1, server.log()
    assert wait_until(lambda: all(events and events[-1] == "[DONE]" for events, _ in streams), timeout=10)
    for events, _ in streams:
        error = json.loads(events[-2])["error"]
        assert error["message"].startswith("The server failed: app::scheduler_TP0"), error
    _all_gone(actors)
