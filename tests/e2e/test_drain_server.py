"""SIGTERM drains a real server: /health and new requests get 503 at once, idle keep-alive
connections are closed at once, the requests in flight finish whole, and the server exits 0 as
soon as the last one has ended; past --shutdown-timeout, those left get the error event."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx

from server import alive, reap, stream_in_thread, wait_until

MODEL = "tiny-llama-v1"


def _stream(url: str, max_tokens: int, events: list[str], started: threading.Event,
            ended: list[float]) -> threading.Thread:
    return stream_in_thread(url, {"model": MODEL, "prompt": "drain me", "max_tokens": max_tokens, "stream": True,
                                  "ignore_eos": True}, events, started, on_end=lambda: ended.append(time.monotonic()))


def _idle_keep_alive(url: str) -> socket.socket:
    """A connection that made one request and stays open, idle (as a client's pool keeps it)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
        answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    return sock


def _all_gone(actors: dict[str, int]) -> None:
    for name, pid in actors.items():
        assert wait_until(lambda: not alive(pid), timeout=5), f"{name} outlived the server"
        reap(pid)


def test_sigterm_lets_the_requests_in_flight_finish_refuses_new_ones_and_exits_zero_once_they_end(start_server):
    server = start_server("--shutdown-timeout", "30", "--context-length", "1024")
    actors = server.actor_pids()
    idle = _idle_keep_alive(server.url)
    streams = [([], threading.Event(), []) for _ in range(2)]
    readers = [_stream(server.url, 300, events, started, ended) for events, started, ended in streams]
    plain: list[httpx.Response] = []
    poster = threading.Thread(target=lambda: plain.append(httpx.post(f"{server.url}/generate", timeout=60, json={
        "text": "drain me too", "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}})), daemon=True)
    poster.start()
    assert all(started.wait(30) for _, started, _ in streams)
    time.sleep(0.05)  # the plain request is in flight too
    signalled = time.monotonic()
    server.signal(signal.SIGTERM)
    assert wait_until(lambda: any("signal received: draining" in line for line in list(server.lines)), timeout=10)

    # The idle connection is closed at once; /health and new requests get 503 at once.
    idle.settimeout(2)
    assert idle.recv(4096) == b"", "the idle keep-alive connection was not closed"
    idle.close()
    refused_at = time.monotonic()
    health = httpx.get(f"{server.url}/health", timeout=5)
    fresh = httpx.post(f"{server.url}/v1/completions", timeout=5, json={"model": MODEL, "prompt": "late",
                                                                          "max_tokens": 4})
    assert health.status_code == 503 and fresh.status_code == 503, (health.text, fresh.text)
    assert "shutting down" in fresh.json()["message"]
    assert time.monotonic() - refused_at < 1.0

    # The requests in flight finish whole, then the server exits 0 at once.
    assert server.wait(timeout=30) == 0, server.log()
    exited = time.monotonic()
    for reader in readers:
        reader.join(timeout=10)
    poster.join(timeout=10)
    for events, _, _ in streams:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-2]
    assert len(plain) == 1 and plain[0].status_code == 200
    assert plain[0].json()["meta_info"]["completion_tokens"] == 300
    last_answer = max(ended[0] for _, _, ended in streams)
    assert exited - last_answer < 2.0, "the server waited after its last request ended"
    assert exited - signalled < 25, "the server waited for --shutdown-timeout"
    _all_gone(actors)


def test_past_the_shutdown_timeout_the_requests_left_get_the_error_event(start_server):
    server = start_server("--shutdown-timeout", "1", "--context-length", "4096")
    actors = server.actor_pids()
    events: list[str] = []
    started, ended = threading.Event(), []
    reader = _stream(server.url, 4000, events, started, ended)
    assert started.wait(30)
    signalled = time.monotonic()
    server.signal(signal.SIGTERM)
    assert server.wait(timeout=30) == 0, server.log()
    reader.join(timeout=10)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    assert 0.9 < ended[0] - signalled < 3.0, "the stream was not given --shutdown-timeout, or more"
    assert len(events) > 10  # it went on streaming while the server drained
    _all_gone(actors)
