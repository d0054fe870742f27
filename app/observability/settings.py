"""The observability flags (logs, request logs, metrics, traces), declared once.

Every actor gets these settings in its configuration (``observability``), so each process logs,
measures and traces by the same rules. Names and defaults are SGLang's where it has the flag.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from app.flags import flag
from app.observability.logs import LEVELS

REQUEST_LOG_LEVELS = (0, 1, 2, 3)
DEFAULT_OTLP_TRACES_ENDPOINT = "http://localhost:4318/v1/traces"


@dataclass(frozen=True, kw_only=True)
class ObservabilitySettings:
    """What the server logs, measures and traces, beyond --log-level and --log-json."""

    log_level_http: str | None = flag(None, "lowest level of the HTTP access log (one line a request, at info); "
                                            "default: --log-level", choices=LEVELS)
    log_requests: bool = flag(False, "log each request's arrival, admission, first token and finish, in every "
                                     "actor, with its request id")
    log_requests_level: int = flag(2, "with --log-requests: 0 metadata, 1 + sampling parameters, 2 + prompt and "
                                      "output cut to 2,048 characters, 3 everything")
    decode_log_interval: int = flag(40, "the scheduler logs a decode line every this many decode steps "
                                        "(and a line per prefill batch)")
    enable_metrics: bool = flag(False, "serve Prometheus metrics from every actor at GET /metrics")
    enable_trace: bool = flag(False, "export OpenTelemetry traces, one per request across the actors "
                                     "(needs the app[trace] extra)")
    otlp_traces_endpoint: str = flag(DEFAULT_OTLP_TRACES_ENDPOINT, "with --enable-trace: the OTLP/HTTP endpoint "
                                                                   "traces are sent to")

    def validate(self) -> None:
        """Raise ValueError naming the flag for anything out of range."""
        if self.log_requests_level not in REQUEST_LOG_LEVELS:
            raise ValueError(f"--log-requests-level must be 0, 1, 2 or 3, got {self.log_requests_level}")
        if self.decode_log_interval < 1:
            raise ValueError(f"--decode-log-interval must be at least 1, got {self.decode_log_interval}")
        if self.enable_trace:
            check_endpoint(self.otlp_traces_endpoint)
            check_trace_packages()

    def to_config(self) -> dict[str, Any]:
        """As it travels to the actors (their JSON configuration's ``observability``)."""
        return asdict(self)

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> ObservabilitySettings:
        """From an actor's configuration (defaults when absent)."""
        return cls(**(config or {}))


TRACE_PACKAGES = ("opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http")
MISSING_PACKAGES = ("--enable-trace needs the OpenTelemetry packages ({packages}): install them with "
                    "pip install 'app[trace]' ({error})")


def check_trace_packages() -> None:
    """Raise ValueError naming --enable-trace when the trace extra is not installed."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
        import opentelemetry.trace  # noqa: F401
    except ImportError as exc:
        raise ValueError(MISSING_PACKAGES.format(packages=", ".join(TRACE_PACKAGES), error=exc)) from None


def check_endpoint(endpoint: str) -> None:
    """Raise ValueError naming --otlp-traces-endpoint unless it is an http(s) URL with a host."""
    from urllib.parse import urlsplit

    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--otlp-traces-endpoint must be an http:// or https:// URL (OTLP over HTTP), "
                         f"got {endpoint!r}")
