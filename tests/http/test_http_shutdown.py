"""Stopping the HTTP server from outside (the server's layers cancel it): requests in flight still
finish, by the shutdown deadline, and no later; over a real local socket."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

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


class Cancelled(NamedTuple):
    outcome: dict[str, object]  # the request's status, or the transport error that ended it
    stopped_after: float  # seconds from the cancellation to serve_http's return


async def cancel_while_serving(backend: EchoBackend, rid: str, deadline_s: float) -> Cancelled:
    """Serve one request, cancel the server (as the server's layers cancel HTTP on a shutdown)
    once the backend has started it, and wait for the request's end."""
    outcome: dict[str, object] = {}
    done = trio.Event()
    async with trio.open_nursery() as outer:
        await outer.start(backend.run)
        with trio.fail_after(10):
            async with trio.open_nursery() as serving:
                binding = await serving.start(partial(serve_http, make_app(backend), HOST, 0,
                                                      deadline=ShutdownDeadline(deadline_s)))
                outer.start_soon(post_completion, binding.url, rid, outcome, done)
                await backend.started.setdefault(rid, trio.Event()).wait()
                cancelled_at = trio.current_time()
                serving.cancel_scope.cancel()
            stopped_after = trio.current_time() - cancelled_at
            await done.wait()
        outer.cancel_scope.cancel()
    return Cancelled(outcome, stopped_after)


async def test_a_cancelled_server_lets_the_requests_in_flight_finish():
    backend = EchoBackend()
    backend.delay_s = 0.05  # before each of the four outputs
    cancelled = await cancel_while_serving(backend, "late", deadline_s=5.0)
    assert cancelled.outcome == {"status": 200}


async def test_a_request_still_running_at_the_deadline_is_cut_off_then():
    backend = EchoBackend()
    backend.delay_s = 60.0  # far past the deadline
    cancelled = await cancel_while_serving(backend, "slow", deadline_s=0.3)
    assert 0.3 <= cancelled.stopped_after < 2.0, cancelled.stopped_after
    assert isinstance(cancelled.outcome.get("error"), httpx.TransportError), cancelled.outcome
    assert backend.closed_early["slow"].is_set()  # the handler released its request when cut off
