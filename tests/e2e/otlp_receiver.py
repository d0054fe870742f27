"""A real OTLP/HTTP trace receiver for the tests: ``POST /v1/traces`` with protobuf bodies.

It decodes each export with opentelemetry-proto's ExportTraceServiceRequest (the message the
collector receives), answers 200 with an empty ExportTraceServiceResponse, and keeps every
span with its process's resource attributes, for the tests to read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

TRACES_PATH = "/v1/traces"


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived: ids in hex, times in ns, attributes decoded."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    kind: int
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    attributes: dict[str, Any]
    resource: dict[str, Any]


@dataclass
class OtlpReceiver:
    """What the server received so far (thread-safe) and where it listens."""

    endpoint: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    exports: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        kind=span.kind,
                        status_code=span.status.code,
                        status_message=span.status.message,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        resource=resource,
                    ))
        with self.lock:
            self.spans.extend(received)
            self.exports += 1

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans once ``done(spans)`` holds; AssertionError with what came after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.snapshot()
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"the expected spans did not arrive in {timeout} s: "
                                     f"{sorted((s.name, s.attributes.get('app.request_id')) for s in spans)}")
            time.sleep(0.05)


def _handler(receiver: OtlpReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.path != TRACES_PATH or self.headers.get("content-type") != "application/x-protobuf":
                self.send_response(404 if self.path != TRACES_PATH else 415)
                self.end_headers()
                return
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            receiver.add(request)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    return Handler


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A receiver on a free localhost port, serving from a thread for the block."""
    receiver = OtlpReceiver()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(receiver))
    receiver.endpoint = f"http://127.0.0.1:{server.server_address[1]}{TRACES_PATH}"
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
