"""OpenTelemetry tracing for one process (--enable-trace): its exporter, and the W3C trace context.

Every process (the ingress and the three actors) has its own :class:`ProcessTracing`: a
TracerProvider whose Resource names the service ``app`` (or ``$OTEL_SERVICE_NAME``) and the
actor (``app.actor``), and a batch span processor that sends the finished spans to
``--otlp-traces-endpoint`` (OTLP over HTTP, protobuf) from a background thread, so a span costs
the serving path only its creation. The SDK's ``OTEL_*`` variables (sampler, batch delay,
exporter headers) apply in every process: the actors inherit the server's environment.
When the process stops, :meth:`ProcessTracing.close` sends what is left, bounded by
:data:`FLUSH_TIMEOUT_S` (inside the default shutdown deadline: an actor killed at the deadline
loses its last spans, nothing else).

One request is one trace across the processes: the ingress starts the trace (or continues the
client's ``traceparent``), and the request's W3C ``traceparent`` string travels in the ipc
messages (GenerateRequest, TokenizedRequest, TextParams); each actor parents its spans on it
(:meth:`ProcessTracing.parent`). A request without one (the warm-up, ``/health_generate``) is
not traced.

Nothing here imports OpenTelemetry at module level: without --enable-trace no process loads
it. With the flag and without the packages, :func:`app.observability.settings.check_trace_packages` refuses to start
(a ValueError naming the flag, exit code 2).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from app.ipc.messages import Finish, FinishReason
from app.observability.settings import ObservabilitySettings

SERVICE_NAME = "app"
TRACER_NAME = "app"
# What the closing flush may take (a collector on the network answers in milliseconds): well within
# --shutdown-timeout's default (5 s), also when the ingress's flush follows the actors'.
FLUSH_TIMEOUT_S = 1.0
# One export's HTTP timeout: a collector that does not answer delays only the exporter's thread.
EXPORT_TIMEOUT_S = 5.0
def finish_attributes(finish: Finish | None, attributes: dict[str, Any]) -> str | None:
    """Add how a request ended to a span's ``attributes``; the span's error (an abort's message),
    or None."""
    if finish is None:
        return None
    attributes["app.finish_reason"] = finish.reason.value
    if finish.status_code is not None:
        attributes["app.status_code"] = finish.status_code
    return (finish.message or "aborted") if finish.reason is FinishReason.ABORT else None


def ns(seconds: float) -> int:
    """A ``time.time()`` value as OpenTelemetry's nanoseconds since the epoch."""
    return int(seconds * 1e9)


class ProcessTracing:
    """This process's tracer, its exporter, and the helpers the span modules share."""

    def __init__(self, actor: str, endpoint: str) -> None:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.actor = actor
        service = os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME  # the SDK's own variable may rename it
        resource = Resource.create({"service.name": service, "app.actor": actor, "process.pid": os.getpid()})
        # Not the global provider: this process's spans go through this object only, and the
        # provider is shut down here (close), not at interpreter exit (actors end with os._exit).
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint,
                                                                              timeout=EXPORT_TIMEOUT_S)))
        self.tracer = self._provider.get_tracer(TRACER_NAME)
        self._propagator = TraceContextTextMapPropagator()
        self._trace = trace
        self.server_kind = trace.SpanKind.SERVER
        self._error = trace.StatusCode.ERROR

    def parent(self, traceparent: str | None) -> Any:
        """The OpenTelemetry Context a span continues from a W3C ``traceparent`` (an empty
        Context, so a new trace, for None or a malformed value)."""
        return self._propagator.extract({"traceparent": traceparent} if traceparent else {})

    def traceparent(self, span: Any) -> str | None:
        """``span``'s W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``): what travels with
        the request so that the other processes' spans become its children."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier.get("traceparent")

    def span(self, name: str, traceparent: str | None, start: float, end: float,
             attributes: Mapping[str, Any], error: str | None = None) -> None:
        """Record a finished span of ``traceparent``'s trace from ``start`` to ``end``
        (``time.time()``); ``error`` marks it failed with that description."""
        span = self.tracer.start_span(name, context=self.parent(traceparent), start_time=ns(start),
                                      attributes=attributes)
        if error is not None:
            self.fail(span, error)
        span.end(end_time=ns(end))

    def fail(self, span: Any, description: str) -> None:
        """Mark ``span``'s status as an error, with ``description``."""
        span.set_status(self._trace.Status(self._error, description))

    def close(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Send the spans still queued and stop the exporter, waiting at most ``timeout_s``
        (the SDK's own flush and shutdown may wait for a collector that does not answer for
        longer: they run in a daemon thread, left behind when the time is up). Returns whether
        it finished in time."""
        import threading

        closing = threading.Thread(target=self._provider.shutdown, name="otel-shutdown", daemon=True)
        closing.start()
        closing.join(timeout_s)
        return not closing.is_alive()


@contextmanager
def process_tracing(settings: ObservabilitySettings, actor: str) -> Iterator[ProcessTracing | None]:
    """This process's tracing while the block runs (None without --enable-trace), flushed and
    closed on leaving it, however it is left."""
    if not settings.enable_trace:
        yield None
        return
    tracing = ProcessTracing(actor, settings.otlp_traces_endpoint)
    try:
        yield tracing
    finally:
        tracing.close()


def actor_tracing(config: dict[str, Any], actor: str) -> Any:
    """:func:`process_tracing` for an actor, from its JSON configuration."""
    return process_tracing(ObservabilitySettings.from_config(config.get("observability")), actor)
