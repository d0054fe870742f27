"""One place that sets up logging for every process of the server, and the one writer of its lines.

Every line carries the actor (``app::scheduler_TP0``) and the pid, so that the output of four
processes stays readable and a log shipper can filter by actor. Human text by default;
``json=True`` gives one JSON object per line. Each process calls :func:`configure_logging`
once, first thing; the supervisor passes the same settings to every child.

How lines stay whole across processes and threads
-------------------------------------------------
The server's stderr has one writer: the supervisor (the main process). Each actor's stderr is a
pipe of its own that the supervisor drains (app.actors.process), splitting it at newlines and
writing each complete line out again. So no two processes ever write to the server's stderr,
and a line can be of any length (a request log with a 2,048-character prompt exceeds
``PIPE_BUF``, the size up to which the kernel keeps concurrent pipe writes apart): nothing
depends on the kernel's atomicity, so no cross-process lock is needed.

Within a process, several threads log (the scheduler's view is written by a thread of its own; libraries
have their own), so every line goes through :class:`LineWriter`: the complete line and its
newline are encoded first and written under a lock, in one ``write`` call (a loop only if the
kernel takes part of it), straight to the descriptor: no text buffer that ``print`` might flush
in pieces. structlog, the standard library's loggers and the supervisor's forwarding of the
actors' lines all use the process's one writer (:func:`stderr_writer`).

In JSON mode every line the server prints is a JSON object: library warnings are captured into
logging (``logging.captureWarnings``); what Python code prints to ``sys.stderr`` (an uncaught
exception's traceback) is wrapped line by line (``sys.stderr`` becomes a writer of JSON lines);
and whatever an actor writes to its stderr descriptor that is not a JSON object (a crash's
traceback from faulthandler, a C library's message) is wrapped into one by the supervisor as it
forwards it (:meth:`LineWriter.forward`).
"""

from __future__ import annotations

import functools
import io
import json as json_module
import logging
import os
import select
import sys
import threading
from datetime import datetime, timezone
from typing import Any

import msgspec
import structlog

LEVELS = ("debug", "info", "warning", "error", "critical")
STDERR_FD = 2


def actor_title(actor: str) -> str:
    """The name shown in `ps`, in log lines and in errors: ``app::<actor>``."""
    return f"app::{actor}"


class LineWriter:
    """Writes whole lines to one descriptor, one line at a time for the whole process."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.json = False  # set by configure_logging: forward() then wraps what is not JSON
        self._lock = threading.Lock()

    def write_line(self, line: str) -> None:
        """``line`` and a newline, written whole before any other line of this process.

        A line cannot be written (stderr closed, its reader gone) is dropped: logging never
        takes the process down.
        """
        data = memoryview((line + "\n").encode("utf-8", "replace"))
        with self._lock:
            while data:
                try:
                    data = data[os.write(self.fd, data):]
                except BlockingIOError:  # a non-blocking descriptor whose reader is behind
                    select.select([], [self.fd], [], 1.0)
                except OSError:
                    return

    def forward(self, line: str, *, source: str, pid: int) -> None:
        """A line another process (an actor) wrote to its stderr: as it is, or in JSON mode
        wrapped into a JSON object (``logger: "stderr"``) unless it is one already."""
        if self.json and not _is_json_object(line):
            line = msgspec.json.encode({
                "event": line, "level": "warning", "logger": "stderr", "actor": source, "pid": pid,
                "timestamp": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"),
            }).decode()
        self.write_line(line)


def _is_json_object(line: str) -> bool:
    if not (line.startswith("{") and line.endswith("}")):
        return False
    try:
        msgspec.json.decode(line)
    except msgspec.DecodeError:
        return False
    return True


class _JsonStderr(io.TextIOBase):
    """``sys.stderr`` in JSON mode: text printed to it (an uncaught exception's traceback, a
    library's ``print``) goes out line by line, each wrapped into a JSON object."""

    def __init__(self, writer: LineWriter, source: str, pid: int) -> None:
        super().__init__()
        self._writer, self._source, self._pid = writer, source, pid
        self._pending = ""
        self._lock = threading.Lock()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._writer.fd

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            self._writer.forward(line, source=self._source, pid=self._pid)
        return len(text)


@functools.cache
def stderr_writer() -> LineWriter:
    """This process's writer of stderr: one per process, as the descriptor is (see the module doc)."""
    return LineWriter(STDERR_FD)


class _LineLogger:
    """structlog's final logger: hands each rendered line to the process's LineWriter."""

    def __init__(self, writer: LineWriter) -> None:
        self._writer = writer

    def msg(self, message: str) -> None:
        self._writer.write_line(message)

    log = debug = info = warn = warning = err = error = critical = exception = fatal = failure = msg


class _LineHandler(logging.Handler):
    """The standard library's handler for the same writer (hypercorn, py.warnings, libraries)."""

    def __init__(self, writer: LineWriter) -> None:
        super().__init__()
        self._writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._writer.write_line(self.format(record))
        except Exception:  # noqa: BLE001 - a broken record must not break the caller
            self.handleError(record)


def _human_line(_logger: Any, _method: str, event: dict[str, Any]) -> str:
    """``<time> <LEVEL> app::actor[pid] message key=value ...``"""
    head = f"{event.pop('timestamp', '')} {event.pop('level', 'info').upper():<7} {event.pop('actor', '')}[{event.pop('pid', '')}]"
    message = event.pop("event", "")
    exception = event.pop("exception", None)
    fields = " ".join(f"{key}={value!r}" if isinstance(value, str) and " " in value else f"{key}={value}"
                      for key, value in event.items())
    line = f"{head} {message}" + (f" {fields}" if fields else "")
    return line + (f"\n{exception}" if exception else "")


def _json_line(_logger: Any, _method: str, event: dict[str, Any]) -> str:
    """One JSON object; a value JSON cannot hold becomes its ``str``. Never raises: text msgspec
    refuses (a lone surrogate) goes through the standard library's encoder, escaped."""
    try:
        return msgspec.json.encode(event, enc_hook=str).decode()
    except (TypeError, ValueError, UnicodeError, OverflowError):
        return json_module.dumps(event, default=str, ensure_ascii=True)


def _numeric(level: str, flag: str) -> int:
    if level not in LEVELS:
        raise ValueError(f"{flag} must be one of {', '.join(LEVELS)}, got {level!r}")
    return getattr(logging, level.upper())


def configure_logging(actor: str, level: str = "info", *, json: bool = False, writer: LineWriter | None = None) -> None:
    """Route structlog, the stdlib loggers of libraries and Python's warnings to ``writer``
    (this process's stderr writer by default)."""
    numeric = _numeric(level, "--log-level")
    writer = writer or stderr_writer()
    writer.json = json
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
    renderer: Any = _json_line if json else _human_line
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=lambda *_args: _LineLogger(writer),
        cache_logger_on_first_use=True,
    )
    handler = _LineHandler(writer)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    logging.captureWarnings(True)  # warnings.warn(...) of libraries: a log line (logger py.warnings)
    if json and writer.fd == STDERR_FD and not isinstance(sys.stderr, _JsonStderr):
        sys.stderr = _JsonStderr(writer, title, pid)


def get_logger(**context: Any) -> Any:
    """A structlog logger with ``context`` bound to every line it writes."""
    return structlog.get_logger().bind(**context)


def get_logger_at(level: str, flag: str, **context: Any) -> Any:
    """A structlog logger that filters at ``level`` of its own (not --log-level), for a log with
    its own flag (--log-level-http); its lines go the same way as every other."""
    wrapper = structlog.make_filtering_bound_logger(_numeric(level, flag))
    return structlog.wrap_logger(None, wrapper_class=wrapper).bind(**context)


def enabled_at(level: str, flag: str, line_level: str = "info") -> bool:
    """Whether a log filtered at ``level`` writes lines of ``line_level``."""
    return _numeric(line_level, flag) >= _numeric(level, flag)
