"""The HTTP side of the metrics (--enable-metrics): every answer counted, and ``GET /metrics``.

:class:`CountedHttp` wraps the ASGI app and counts each HTTP request once it is over, by route
and status, whatever answered it: a handler, the key check, the router's 404 and 405, or the
ASGI app's own 408 and 413 while reading the body. The status is the one its response started
with; a request that ended without a response (the client left first) counts as 499, nginx's
"client closed request". Paths that are no route share the label ``other``, so that scanners
cannot make the number of series grow. The connections refused past ``--max-connections``
never reach the app: app/http/server.py reports them (``ServerMetrics.connection_refused``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.http.primitives import Receive, Request, Responder, Send
from app.observability.ingress_metrics import ServerMetrics

CLIENT_CLOSED = 499
OTHER_ROUTE = "other"


class CountedHttp:
    """``app`` (an ASGI app whose routes are ``paths``), each HTTP request counted in ``recorder``."""

    def __init__(self, app: Any, paths: frozenset[str], recorder: ServerMetrics) -> None:
        self.app = app
        self.paths = paths
        self.recorder = recorder

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = CLIENT_CLOSED

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.recorder.http_answered(self.route(scope["path"]), status)

    def route(self, path: str) -> str:
        """The route label of ``path``: the route's own path, or ``other``."""
        path = path.rstrip("/") or "/"
        return path if path in self.paths else OTHER_ROUTE


class TextResponse:
    """One text body (the exposition format) with its content type."""

    def __init__(self, body: bytes, content_type: str) -> None:
        self.status = 200
        self.headers: list[tuple[str, str]] = []
        self.body = body
        self.content_type = content_type

    async def send_to(self, send: Send) -> None:
        head = [(b"content-type", self.content_type.encode("latin-1")),
                (b"content-length", str(len(self.body)).encode())]
        head += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers]
        await send({"type": "http.response.start", "status": self.status, "headers": head})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


def metrics_handler(recorder: ServerMetrics) -> Callable[[Request], Responder]:
    """What answers ``GET /metrics``: every metric, in the format the scraper's Accept asks for
    (Prometheus text by default, OpenMetrics when asked)."""

    def answer(request: Request) -> Responder:
        body, content_type = recorder.exposition(request.headers.get("accept"))
        return TextResponse(body, content_type)

    return answer
