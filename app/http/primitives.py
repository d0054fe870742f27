"""The few types every part of the HTTP layer shares: a request, a response, a route, a handler.

A handler takes a :class:`Request` (whose body has already been read) and returns a
:class:`Responder`, which knows how to send itself over ASGI: :class:`JsonResponse` for one
body, ``sse.EventStream`` for Server-Sent Events. Middleware wraps handlers, so that auth,
metrics and request logs see every request and every response status in one place.
"""

from __future__ import annotations

import enum
import uuid
from contextlib import AsyncExitStack
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol, TypeVar

import msgspec

from app.http.errors import ApiError, from_validation

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
T = TypeVar("T")

_MAX_REQUEST_ID_CHARS = 256


def checked_request_id(value: str, name: str) -> str:
    """``value`` when it can be a request id (it is logged and sent back in a header); ApiError
    400 naming ``name`` otherwise."""
    if not 0 < len(value) <= _MAX_REQUEST_ID_CHARS or not value.isprintable() or not value.isascii():
        raise ApiError.bad_request(f"{name} must be 1 to {_MAX_REQUEST_ID_CHARS} printable ASCII characters", name)
    return value


class Responder(Protocol):
    """A response: its status and headers are known before it is sent (middleware reads them)."""

    status: int
    headers: list[tuple[str, str]]

    async def send_to(self, send: Send) -> None: ...


class Access(enum.Enum):
    """Which key a route needs (auth.py checks it; its docstring has the whole matrix)."""

    OPEN = "open"  # none, ever: /health, /metrics (load balancers and scrapers call them)
    API = "api"  # the API key when one is set (the admin key opens it too)
    ADMIN = "admin"  # the admin key when one is set, else the API key when that is set


class Request:
    """One HTTP request, its body read in full."""

    __slots__ = ("method", "path", "query_string", "headers", "body", "request_id", "resources", "admin", "traceparent")

    def __init__(self, scope: dict[str, Any], body: bytes) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query_string: bytes = scope.get("query_string", b"")
        # Lower-cased names; a repeated header keeps its last value.
        self.headers: dict[str, str] = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self.body = body
        # The client's X-Request-Id when it sent one, else a fresh id; answered in a header.
        self.request_id = self._client_request_id() or uuid.uuid4().hex
        # Closed after the response is sent, even when the client leaves: what a streamed
        # response reads from (its RequestStream) lives here, beyond the handler's return.
        self.resources = AsyncExitStack()
        # Whether the caller may use the admin routes; the key check sets it (auth.py).
        self.admin = False
        # The W3C trace context of the request's root span (--enable-trace: http_spans.py sets it).
        self.traceparent: str | None = None

    def _client_request_id(self) -> str | None:
        value = self.headers.get("x-request-id", "").strip()
        return checked_request_id(value, "X-Request-Id") if value else None

    def json(self, type: type[T]) -> T:
        """The body decoded into ``type``; ApiError 400 naming the field when it does not fit."""
        try:
            return msgspec.json.decode(self.body, type=type)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise from_validation(exc) from None
        except RecursionError:  # msgspec recurses into a value it skips or decodes as Any
            raise ApiError.bad_request("The JSON body is nested too deeply.") from None


class JsonResponse:
    """A response with one JSON body (also used for errors)."""

    def __init__(self, value: Any, status: int = 200, headers: list[tuple[str, str]] | None = None) -> None:
        self.status = status
        self.headers = headers if headers is not None else []
        self.body = msgspec.json.encode(value)

    async def send_to(self, send: Send) -> None:
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(self.body)).encode())]
        head += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers]
        await send({"type": "http.response.start", "status": self.status, "headers": head})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


def error_response(error: ApiError) -> JsonResponse:
    return JsonResponse(error.body(), error.status, list(error.headers))


Handler = Callable[[Request], Awaitable[Responder]]
Middleware = Callable[[Handler], Handler]


class Route(NamedTuple):
    """One route: how it is served, and how the OpenAPI document describes it."""

    method: str
    path: str
    handler: Handler
    summary: str
    body: type | None = None  # the request body's Struct
    response: Any = None  # the response body's type
    stream_event: type | None = None  # the Struct each SSE event holds, when it can stream
    access: Access = Access.API  # which key it needs
