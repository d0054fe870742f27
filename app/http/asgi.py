"""The ASGI application: lifespan, reading bodies, routing, middleware, and client disconnects.

How one HTTP request is served::

    read the body (413 past the limit)
    └─ nursery ─┬─ watch receive() for http.disconnect → cancel the request's scope
                └─ middleware… → error boundary → router → handler → response.send_to(send)
                   then close the request's resources (its RequestStream: aborts the unfinished)

hypercorn reports a disconnect only to a task awaiting ``receive()``, and writes to a closed
connection succeed silently; hence the watcher task per request, for streamed and
non-streamed answers alike. Middleware (``Middleware = Callable[[Handler], Handler]``) is the
hook for auth, metrics and request logs: it sees every request and every response's status.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import structlog
import trio

from app.http.auth import ApiKeys, require_keys
from app.http.backend import Backend, RequestError, ServerError
from app.http.errors import ApiError, from_backend
from app.http.openai_adapter import TokenNamer, token_id_name
from app.http.primitives import Handler, Middleware, Receive, Request, Responder, Route, Send, error_response
from app.http.routes import Api, MetricsHandler, RouteSettings
from app.ipc.trace import RequestTrace
from app.observability.access_log import AccessLog

MAX_BODY_BYTES = 32 * 1024 * 1024
# Seconds a client has to send a request's whole body, once its headers are in (--http-read-timeout).
BODY_READ_TIMEOUT_S = 30.0

_log = structlog.get_logger("app.http")


class _ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class Router:
    """Dispatch on the exact path, then the method: 404 and 405 (with Allow) otherwise."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self._table: dict[str, dict[str, Handler]] = {}
        for route in routes:
            self._table.setdefault(route.path, {})[route.method] = route.handler

    async def __call__(self, request: Request) -> Responder:
        path = request.path.rstrip("/") or "/"
        methods = self._table.get(path)
        if methods is None:
            raise ApiError(404, f"There is no route {request.path}.")
        handler = methods.get(request.method)
        if handler is None:
            allowed = ", ".join(sorted(methods))
            message = f"{request.method} is not allowed on {path}; use {allowed}."
            raise ApiError(405, message, headers=(("allow", allowed),))
        return await handler(request)


def error_boundary(handler: Handler) -> Handler:
    """Render every failure of ``handler`` as an error response, so middleware sees a status."""

    async def guarded(request: Request) -> Responder:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc)
        except (RequestError, ServerError) as exc:
            return error_response(from_backend(exc))
        except Exception:
            _log.exception("request failed", path=request.path, rid=request.request_id)
            return error_response(ApiError(500, "Internal server error."))

    return guarded


class HttpApp:
    """The ASGI 3 callable that hypercorn serves."""

    def __init__(self, handler: Handler, *, max_body_bytes: int = MAX_BODY_BYTES,
                 body_read_timeout_s: float = BODY_READ_TIMEOUT_S, trace: RequestTrace | None = None,
                 access_log: AccessLog | None = None, paths: frozenset[str] = frozenset()) -> None:
        self._handler = handler
        self._access_log = access_log  # one line per request (observability/access_log.py); None: off
        self.paths = paths  # every route's path (metrics label requests by route, other paths as one)
        self._max_body_bytes = max_body_bytes
        self._body_read_timeout_s = body_read_timeout_s
        self._trace = trace or RequestTrace()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self._access_log is None:
                await self._http(scope, receive, send)
            else:
                await self._access_log.serve(self._http, scope, receive, send)
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1003})

    async def _http(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        try:
            with trio.fail_after(self._body_read_timeout_s):
                body = await _read_body(scope, receive, self._max_body_bytes)
        except trio.TooSlowError:
            # The rest of the body would still arrive after the answer: the connection cannot be
            # reused, and hypercorn closes it once the answer is sent.
            message = f"The request body did not arrive within {self._body_read_timeout_s:g} s."
            await error_response(ApiError(408, message, headers=(("connection", "close"),))).send_to(send)
            return
        except ApiError as exc:
            await error_response(exc).send_to(send)
            return
        except _ClientGone:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            await self._respond(scope, body, _shield_last_message(send))
            nursery.cancel_scope.cancel()

    async def _respond(self, scope: dict[str, Any], body: bytes, send: Send) -> None:
        try:
            request = Request(scope, body)
        except ApiError as exc:
            await error_response(exc).send_to(send)
            return
        self._trace.mark("http.request", request.request_id)
        async with request.resources:
            try:
                response = await self._handler(request)
            except ApiError as exc:  # raised by a middleware instead of returned
                response = error_response(exc)
            response.headers.append(("x-request-id", request.request_id))
            await response.send_to(send)


async def _read_body(scope: dict[str, Any], receive: Receive, limit: int) -> bytes:
    """The whole request body; ApiError 413 past ``limit`` bytes, _ClientGone on a disconnect."""
    too_large = ApiError(413, f"The request body is larger than {limit} bytes.")
    for name, value in scope["headers"]:
        if name.lower() == b"content-length" and value.isdigit() and int(value) > limit:
            raise too_large
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _shield_last_message(send: Send) -> Send:
    """``send``, with the response's last message sent out of reach of cancellation.

    Within that send, hypercorn ends the request: it tells the app ``http.disconnect`` (which
    wakes our watcher, and its cancel would land in that same send) and then readies the
    connection for its next request, starting the idle timer that closes it after the keep-alive
    timeout or at once on shutdown. Cancelled half-way, an idle keep-alive connection would have
    no timer and stay open until the client closes it: past the connection cap for good, and
    through a graceful shutdown's whole grace period. The socket write inside is shielded by
    hypercorn already, so the shield adds no wait.
    """

    async def sending(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            with trio.CancelScope(shield=True):
                await send(message)
        else:
            await send(message)

    return sending


async def _cancel_on_disconnect(receive: Receive, request_scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    request_scope.cancel()


async def _lifespan(receive: Receive, send: Send) -> None:
    """Nothing to set up: the ingress owns the backend and starts the server once it is ready."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def make_app(
    backend: Backend,
    *,
    keys: ApiKeys = ApiKeys(),
    middleware: Sequence[Middleware] = (),
    settings: RouteSettings = RouteSettings(),
    token_namer: TokenNamer = token_id_name,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_read_timeout_s: float = BODY_READ_TIMEOUT_S,
    trace: RequestTrace | None = None,
    access_log: AccessLog | None = None,
    metrics: MetricsHandler | None = None,
) -> HttpApp:
    """The ASGI app serving ``backend``.

    ``middleware`` wraps the routes, first in the list outermost (metrics, request logs); the
    key check (auth.py: every route's access against ``keys``) is outside them all.
    ``token_namer`` names tokens in logprobs. ``access_log`` writes a line per request, every
    answer included (the 408 and 413 of the body's reading too). ``metrics`` answers ``GET
    /metrics`` (404 without).
    """
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be > 0, got {max_body_bytes}")
    if not body_read_timeout_s > 0:
        raise ValueError(f"body_read_timeout_s must be > 0, got {body_read_timeout_s}")
    api = Api(backend, msgspec.structs.replace(settings, secured=keys.any), token_namer, metrics)
    routes = api.routes()
    handler: Handler = error_boundary(Router(routes))
    for wrap in reversed([require_keys(keys, routes), *middleware]):
        handler = wrap(handler)
    return HttpApp(handler, max_body_bytes=max_body_bytes, body_read_timeout_s=body_read_timeout_s, trace=trace,
                   access_log=access_log, paths=frozenset(route.path for route in routes))
