"""Serving the ASGI app with hypercorn on trio, in the caller's nursery, with a cap on connections.

Stopping is always graceful, whether ``shutdown`` is set or the caller is cancelled: no new
connections, idle ones close, requests in flight finish by the shutdown deadline, then are
cancelled. Open streams end only when the backend ends them, so the server answers every
request in flight (ServerError) before HTTP stops; each client then gets an error event and
``data: [DONE]``.
"""

from __future__ import annotations

import logging
import resource
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, NamedTuple

import msgspec
import trio
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app

from app.http.errors import ApiError
from app.observability.access_log import AccessLog
from app.shutdown import ShutdownDeadline


class BindError(OSError):
    """The address cannot be listened on (in use, or not one of this machine's)."""


class HttpBinding(NamedTuple):
    """Where the server listens (the real port when it was asked for port 0)."""

    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


# Connections the kernel completes before hypercorn accepts them (capped by net.core.somaxconn).
# hypercorn's default of 100 is too few for a burst: the kernel drops the SYNs past it, and
# each of those clients waits for its SYN retransmit (1 s on Linux) before it is even read;
# 128 requests sent at once had their last answer after ~1.05 s instead of ~0.13 s on a 2-core
# box (lab/notes/benchmarks.md, "Intake and output path of a burst"). 2048 is uvicorn's default.
LISTEN_BACKLOG = 2048


# Open connections at most (--max-connections): past it, a new connection is answered 503 and
# closed at once, so that a flood of idle or trickling clients cannot exhaust file descriptors.
MAX_CONNECTIONS = 2048
# Descriptors the process needs besides its connections (channels, pidfds, logs, the model files).
FILE_RESERVE = 256
_REFUSAL_DEADLINE_S = 1.0  # at most this long spent answering one connection past the cap
# Refusals answered at once at most; past them a connection is closed unanswered, so that a flood
# past the cap holds no more than this many descriptors (each answer holds one for up to 1 s).
MAX_REFUSING = 64


def _config(host: str, port: int) -> Config:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.backlog = LISTEN_BACKLOG
    config.accesslog = None  # request logs come from our middleware, not hypercorn's format
    config.errorlog = logging.getLogger("hypercorn.error")  # through our logging set-up
    return config


def _refusal(message: str = "Too many open connections; retry shortly.") -> bytes:
    body = msgspec.json.encode(ApiError(503, message).body())
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGate:
    """Counts open connections; one past ``limit`` gets a 503 and is closed, never served (closed
    unanswered while ``MAX_REFUSING`` others are being answered). Once ``draining`` (the server
    stops), every new connection is answered so."""

    def __init__(self, limit: int, access_log: AccessLog | None = None,
                 on_refusal: Callable[[], None] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"the connection limit must be at least 1, got {limit}")
        self.limit = limit
        self.on_refusal = on_refusal  # told of each 503 answered (metrics)
        self.open = 0  # connections being served now
        self.refused = 0  # connections refused since start
        self.refusing = 0  # refused connections being answered now (each holds a descriptor)
        self._refusal = _refusal()
        self.draining = False  # the server is stopping: new connections get a 503 and are closed
        self._stopping = _refusal("The server is shutting down.")
        self._access_log = access_log  # a line for each refusal answered

    async def serve(self, connection: Callable[[trio.SocketStream], Awaitable[None]], stream: trio.SocketStream) -> None:
        if self.draining:
            if self.refusing >= MAX_REFUSING:
                await trio.aclose_forcefully(stream)
                return
            self.refusing += 1
            try:
                await self._refuse(stream, self._stopping)
            finally:
                self.refusing -= 1
            return
        if self.open >= self.limit:
            self.refused += 1
            if self.refusing >= MAX_REFUSING:
                await trio.aclose_forcefully(stream)
                return
            self.refusing += 1
            if self.on_refusal is not None:
                self.on_refusal()
            try:
                await self._refuse(stream, self._refusal)
            finally:
                self.refusing -= 1
            return
        self.open += 1
        try:
            await connection(stream)
        finally:
            self.open -= 1

    async def _refuse(self, stream: trio.SocketStream, answer: bytes) -> None:
        """Answer ``answer`` (a 503), then read what the client sent until it closes (closing a socket with
        unread data resets it, and the client may lose the answer), within a deadline."""
        started, sent, peer = time.perf_counter(), 0, _peer(stream)
        with trio.move_on_after(_REFUSAL_DEADLINE_S):
            try:
                await stream.send_all(answer)
                sent = len(answer)
                await stream.send_eof()
                while await stream.receive_some(65536):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        await trio.aclose_forcefully(stream)
        if self._access_log is not None:
            self._access_log.refused(peer, 503, sent, started)


def _peer(stream: trio.SocketStream) -> Any:
    try:
        return stream.socket.getpeername()
    except OSError:
        return None


class _Connection(TCPServer):
    """hypercorn's handler of one connection, which ends as soon as the client has closed it.

    hypercorn's own keeps its idle timer running once the client's end arrives, and so holds the
    socket (and its place under the cap) for up to the keep-alive timeout (5 s) after the client
    has gone: clients that open a connection per request would be refused while far fewer are
    open. Once the reads are over there is nothing left to time out: the handler ends (and the
    socket closes) as soon as the requests in flight do.
    """

    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()


def raise_file_limit(needed: int) -> int:
    """Raise this process's soft limit of open files toward ``needed`` (up to the hard limit);
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


@asynccontextmanager
async def serving_http(
    app: Any,
    host: str,
    port: int,
    *,
    deadline: ShutdownDeadline,
    max_connections: int = MAX_CONNECTIONS,
    access_log: AccessLog | None = None,
    on_refusal: Callable[[], None] | None = None,
    draining: trio.Event | None = None,
    sockets: list[socket.socket] | None = None,
) -> AsyncIterator[HttpBinding]:
    """:func:`serve_http` for as long as the block runs; yields where it listens. Leaving the
    block, however (cancelled, raising, or not), stops it gracefully by ``deadline``."""
    async with trio.open_nursery() as nursery:
        binding = await nursery.start(
            partial(serve_http, app, host, port, deadline=deadline, max_connections=max_connections,
                    access_log=access_log, on_refusal=on_refusal, draining=draining, sockets=sockets))
        try:
            yield binding
        finally:
            nursery.cancel_scope.cancel()


async def serve_http(
    app: Any,
    host: str,
    port: int,
    *,
    shutdown: trio.Event | None = None,
    deadline: ShutdownDeadline | None = None,
    max_connections: int = MAX_CONNECTIONS,
    access_log: AccessLog | None = None,
    on_refusal: Callable[[], None] | None = None,
    draining: trio.Event | None = None,
    sockets: list[socket.socket] | None = None,
    task_status: trio.TaskStatus[HttpBinding] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``host:port`` until ``shutdown`` is set or the caller cancels.

    Reports the bound address through ``task_status`` once it accepts connections. Raises
    BindError (an OSError) when the address cannot be bound. Either way of stopping is
    graceful: no new connections, idle keep-alive ones close at once, and requests in flight
    have until ``deadline`` (by default 5 s from the stop), then are cancelled. A cancelled
    caller waits for that too, as for ``trio.run_process``: the connections live in a shielded
    scope.
    hypercorn's connection handler serves each connection; the accept loop is ours, so that
    ``max_connections`` can be enforced (hypercorn has no such limit); ``on_refusal`` is told of
    each connection answered 503 past it. Once ``draining`` is set (a SIGTERM: the server lets
    its requests finish before it stops), idle keep-alive connections close at once, busy ones
    after their response, and new ones are answered 503 and closed. Its lifespan is not run:
    the app's lifespan has nothing to do. ``sockets``: listening sockets bound already (shared
    with other processes: app/front.py), instead of binding ``host:port`` here.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    config = _config(host, port)
    if sockets is None:
        try:
            sockets = config.create_sockets().insecure_sockets
            for sock in sockets:
                sock.listen(config.backlog)
        except OSError as exc:
            raise BindError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(sock)) for sock in sockets]
    context = WorkerContext(None)
    gate = ConnectionGate(max_connections, access_log, on_refusal)
    asgi = wrap_app(app, config.wsgi_max_body_size, "asgi")
    handler = partial(gate.serve, partial(_Connection, asgi, config, context, ConnectionState({})))
    bound = sockets[0].getsockname()
    stop = trio.Event()
    closing = trio.CancelScope()  # the wait for ``draining``, ended with the server
    async with trio.open_nursery() as nursery:
        try:
            await nursery.start(_serve_connections, handler, listeners, context, deadline or ShutdownDeadline(), stop)
            if draining is not None:
                nursery.start_soon(_close_connections_when, draining, gate, context, closing)
            task_status.started(HttpBinding(bound[0], bound[1]))
            if shutdown is None:
                await trio.sleep_forever()
            await shutdown.wait()
        finally:
            stop.set()
            closing.cancel()


async def _close_connections_when(draining: trio.Event, gate: ConnectionGate, context: WorkerContext,
                                  scope: trio.CancelScope) -> None:
    """Once ``draining`` is set: new connections are refused, idle ones close (hypercorn closes an
    idle connection once its context is terminated, and a busy one after its response)."""
    with scope:
        await draining.wait()
        gate.draining = True
        await context.terminated.set()


async def _serve_connections(
    handler: Callable[[trio.SocketStream], Awaitable[None]],
    listeners: list[trio.SocketListener],
    context: WorkerContext,
    deadline: ShutdownDeadline,
    stop: trio.Event,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept and serve connections until ``stop``, then drain them by ``deadline``: all in a
    shielded scope, which only ``stop`` and the deadline end."""
    with trio.CancelScope(shield=True) as drain:
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as acceptors:
                acceptors.start_soon(partial(trio.serve_listeners, handler, listeners, handler_nursery=connections))
                task_status.started()
                await stop.wait()
                acceptors.cancel_scope.cancel()  # stop accepting; the listeners close
            # Idle keep-alive connections close at once; requests in flight get until the deadline.
            await context.terminated.set()
            drain.deadline = deadline.start()
