"""Stopping the HTTP server from outside (the server's layers cancel it): requests in flight still
finish, by the shutdown deadline, and no later; over a real local socket."""

from __future__ import annotations

from functools import partial

import httpx
import trio
from echo_backend import EchoBackend

from app.http.asgi import make_app
from app.http.server import serve_http
from app.shutdown import ShutdownDeadline

HOST = "127.0.0.1"


async def post_completion(url: str, rid: str, outcome: dict[str, object], done: trio.Event) -> None:
    """One request; records its status, or the transport error that ended it."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            response = await client.post("/v1/completions", json={"prompt": "abcd"}, headers={"x-request-id": rid})
            outcome["status"] = response.status_code
    except httpx.TransportError as exc:
        outcome["error"] = exc
    finally:
        done.set()


async def test_a_cancelled_server_lets_the_requests_in_flight_finish():
    backend = EchoBackend()
    backend.delay_s = 0.05  # before each of the four outputs
    outcome: dict[str, object] = {}
    done = trio.Event()
    async with trio.open_nursery() as outer:
        await outer.start(backend.run)
        with trio.fail_after(10):
            async with trio.open_nursery() as serving:
                binding = await serving.start(partial(serve_http, make_app(backend), HOST, 0,
                                                      deadline=ShutdownDeadline(5.0)))
                outer.start_soon(post_completion, binding.url, "late", outcome, done)
                await backend.started.setdefault("late", trio.Event()).wait()
                serving.cancel_scope.cancel()  # as the server's layers cancel HTTP on a shutdown
            await done.wait()
        outer.cancel_scope.cancel()
    assert outcome == {"status": 200}


async def test_a_request_still_running_at_the_deadline_is_cut_off_then():
    backend = EchoBackend()
    backend.delay_s = 60.0  # far past the deadline
    outcome: dict[str, object] = {}
    done = trio.Event()
    async with trio.open_nursery() as outer:
        await outer.start(backend.run)
        with trio.fail_after(10):
            async with trio.open_nursery() as serving:
                binding = await serving.start(partial(serve_http, make_app(backend), HOST, 0,
                                                      deadline=ShutdownDeadline(0.3)))
                outer.start_soon(post_completion, binding.url, "slow", outcome, done)
                await backend.started.setdefault("slow", trio.Event()).wait()
                cancelled_at = trio.current_time()
                serving.cancel_scope.cancel()
            stopped_after = trio.current_time() - cancelled_at
            await done.wait()
        outer.cancel_scope.cancel()
    assert 0.3 <= stopped_after < 2.0, stopped_after
    assert isinstance(outcome.get("error"), httpx.TransportError), outcome
    assert backend.closed_early["slow"].is_set()  # the handler released its request when cut off
