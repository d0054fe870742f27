"""The root span of each HTTP request (--enable-trace): the ingress's middleware.

The span ``<METHOD> <path>`` (kind SERVER) covers the request from its handler's start until its
response has been sent in full: for a stream, until the last event. It continues the client's
W3C ``traceparent`` header when there is a valid one, and starts a new trace otherwise. Its own
context goes into ``request.traceparent``, which the routes copy into every GenerateRequest
(each choice of ``n``): the actors' spans become its children, one trace per HTTP request.

Attributes (OpenTelemetry's HTTP names where they have one): ``http.request.method``,
``url.path``, ``http.response.status_code``, ``app.request_id``. No header, key or body is
recorded.
"""

from __future__ import annotations

from typing import Any

from app.http.primitives import Handler, Request, Responder, Send
from app.observability.tracing import ProcessTracing


class HttpSpans:
    """Middleware (``Handler -> Handler``) that wraps every request in its root span."""

    def __init__(self, tracing: ProcessTracing) -> None:
        self.tracing = tracing

    def __call__(self, handler: Handler) -> Handler:
        tracing = self.tracing

        async def traced(request: Request) -> Responder:
            span = tracing.tracer.start_span(
                f"{request.method} {request.path}",
                context=tracing.parent(request.headers.get("traceparent")),
                kind=tracing.server_kind,
                attributes={"http.request.method": request.method, "url.path": request.path,
                            "app.request_id": request.request_id},
            )
            request.traceparent = tracing.traceparent(span)
            try:
                response = await handler(request)
            except BaseException as exc:
                tracing.fail(span, type(exc).__name__)
                span.end()
                raise
            return TracedResponse(response, span, tracing, request)

        return traced


class TracedResponse:
    """``response``, ending ``span`` once it has been sent (or its sending failed)."""

    def __init__(self, response: Responder, span: Any, tracing: ProcessTracing, request: Request) -> None:
        self.response = response
        self.span = span
        self.tracing = tracing
        self.request = request

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def headers(self) -> list[tuple[str, str]]:
        return self.response.headers

    async def send_to(self, send: Send) -> None:
        span, status = self.span, self.response.status
        # The body's rid may have replaced the header's id (native /generate) in the handler.
        span.set_attribute("app.request_id", self.request.request_id)
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.tracing.fail(span, f"HTTP {status}")
        try:
            await self.response.send_to(send)
        except BaseException as exc:  # the client left mid-stream (cancelled), or the write failed
            self.tracing.fail(span, f"response not sent in full: {type(exc).__name__}")
            raise
        finally:
            span.end()
