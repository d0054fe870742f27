"""One place that sets up logging for every process of the server.

Every line carries the actor (``app::scheduler_TP0``) and the pid, so interleaved output of
four processes stays readable, and a log shipper can filter by actor. Human text by default;
``json=True`` gives one JSON object per line. Each process calls :func:`configure_logging`
once, first thing; the supervisor passes the same settings to every child.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error", "critical")


def actor_title(actor: str) -> str:
    """The name shown in `ps`, in log lines and in errors: ``app::<actor>``."""
    return f"app::{actor}"


def _human_line(_logger: Any, _method: str, event: dict[str, Any]) -> str:
    """``<time> <LEVEL> app::actor[pid] message key=value ...``"""
    head = f"{event.pop('timestamp', '')} {event.pop('level', 'info').upper():<7} {event.pop('actor', '')}[{event.pop('pid', '')}]"
    message = event.pop("event", "")
    exception = event.pop("exception", None)
    fields = " ".join(f"{key}={value!r}" if isinstance(value, str) and " " in value else f"{key}={value}"
                      for key, value in event.items())
    line = f"{head} {message}" + (f" {fields}" if fields else "")
    return line + (f"\n{exception}" if exception else "")


def configure_logging(actor: str, level: str = "info", *, json: bool = False, stream: TextIO | None = None) -> None:
    """Route structlog (and the stdlib loggers of libraries) to ``stream`` (stderr)."""
    if level not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}")
    stream = stream or sys.stderr
    numeric = getattr(logging, level.upper())
    title, pid = actor_title(actor), os.getpid()

    def add_actor(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("actor", title)
        event.setdefault("pid", pid)
        return event

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_actor,
        structlog.processors.format_exc_info,
    ]
    renderer: Any = structlog.processors.JSONRenderer() if json else _human_line
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
    # Libraries (hypercorn, transformers) log through the stdlib: same stream, same shape.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)


def get_logger(**context: Any) -> Any:
    """A structlog logger with ``context`` bound to every line it writes."""
    return structlog.get_logger().bind(**context)
