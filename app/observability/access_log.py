"""The HTTP access log: one line per request, at info, filtered by --log-level-http.

The line (event ``http``) says what was asked and what was answered: method, path, status,
bytes of body sent, duration from the request's headers to its last byte, the request id
(``rid``: the client's X-Request-Id, the body's rid, or ours, as the ``x-request-id`` response
header says) and the client's address. It is written when the answer ends, whoever answered:
the routes, the key check, a 408 for a body that arrives too slowly, a 413, and the 503 for a
connection past --max-connections (before any request is read: method and path are null).

What it never holds: headers (Authorization carries the API key) and the query string (where
some clients put a key); only the path.

A client that leaves before the answer starts gets status 499 (as nginx logs it); one that
leaves during a stream keeps the status it was sent, with ``completed: false``. An exception
out of the app before any answer is logged as the 500 the server then sends.
"""

from __future__ import annotations

import time
from typing import Any

from app.observability.logs import enabled_at, get_logger_at

Send = Any  # ASGI send: an async callable taking one message
CLIENT_CLOSED = 499


def _client(address: Any) -> str | None:
    if not address:
        return None
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


class AccessRecord:
    """One request's answer, as its ASGI messages tell it; :meth:`send` is the app's ``send``."""

    __slots__ = ("_send", "status", "bytes", "rid", "completed")

    def __init__(self, send: Send, rid: str | None) -> None:
        self._send = send
        self.status = CLIENT_CLOSED
        self.bytes = 0
        self.rid = rid
        self.completed = False

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            for name, value in message.get("headers", ()):
                if name == b"x-request-id":
                    self.rid = value.decode("latin-1")
        elif kind == "http.response.body":
            self.bytes += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.completed = True
        await self._send(message)


class AccessLog:
    """Writes the access lines; build it with :meth:`for_level` (None when they are filtered out)."""

    def __init__(self, level: str) -> None:
        self._log = get_logger_at(level, "--log-level-http", logger="access")

    @classmethod
    def for_level(cls, level: str) -> AccessLog | None:
        """The access log at ``level`` (--log-level-http, else --log-level); None when a line at
        info would not be written, so that serving pays nothing for it."""
        return cls(level) if enabled_at(level, "--log-level-http") else None

    async def serve(self, app: Any, scope: dict[str, Any], receive: Any, send: Send) -> None:
        """Run ``app`` on one HTTP request and write its line when it ends, however it ends."""
        started = time.perf_counter()
        record = AccessRecord(send, _client_request_id(scope))
        try:
            await app(scope, receive, record.send)
        except Exception:
            if record.status == CLIENT_CLOSED:  # nothing was sent: the server answers 500
                record.status = 500
            raise
        finally:
            self._log.info(
                "http",
                method=scope.get("method"),
                path=scope.get("path"),
                status=record.status,
                bytes=record.bytes,
                duration_ms=round((time.perf_counter() - started) * 1000, 3),
                rid=record.rid,
                client=_client(scope.get("client")),
                completed=record.completed,
            )

    def refused(self, address: Any, status: int, sent: int, started: float) -> None:
        """A connection answered before any request was read (the --max-connections 503)."""
        self._log.info("http", method=None, path=None, status=status, bytes=sent,
                       duration_ms=round((time.perf_counter() - started) * 1000, 3), rid=None,
                       client=_client(address), completed=True)


def _client_request_id(scope: dict[str, Any]) -> str | None:
    """The client's X-Request-Id, for an answer sent before the request is parsed (a 408)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"x-request-id":
            text = value.decode("latin-1").strip()
            return text[:256] if text.isprintable() else None
    return None
