"""Opt-in per-request timestamps: when each request reached each actor (for lab/tools/bench_intake.py).

With ``APP_TRACE_DIR`` set in the server's environment (the actors inherit it), every process
appends one line per event to ``$APP_TRACE_DIR/<actor>-<pid>.tsv``::

    <time.monotonic()>\\t<event>\\t<rid>\\t<detail>

The events: ``http.request`` (our ASGI app has the request's body), ``ingress.submit`` (sent
towards the tokenizer), ``tokenizer.recv``, ``tokenizer.sent``, ``scheduler.recv`` (in the
scheduler's inbox), ``scheduler.add`` (given to the engine), ``scheduler.step`` and
``scheduler.stepped`` (a step: the messages applied before it, the outputs it made),
``detokenizer.recv`` and ``detokenizer.sent`` (a step's outputs, with their count) and
``ingress.out`` (an output routed to its request; detail 1 for the final one).

``time.monotonic()`` is the system-wide CLOCK_MONOTONIC on Linux, so the lines of all the
processes (and of a client on the same host) can be merged on one time line. Each line is
one ``os.write`` of an O_APPEND descriptor, so nothing is lost when an actor exits through
``os._exit``. Each actor makes its :class:`RequestTrace` with ``RequestTrace.from_env``;
without the variable its ``mark`` does nothing and ``enabled`` is False (callers that would
loop to mark guard on it); tracing changes no behaviour, only adds these writes.
"""

from __future__ import annotations

import os
import time

_ENV = "APP_TRACE_DIR"


class RequestTrace:
    """One process's trace file; ``RequestTrace()`` (no file) records nothing."""

    def __init__(self, fd: int | None = None) -> None:
        self._fd = fd

    @classmethod
    def from_env(cls, actor: str) -> RequestTrace:
        """This process's trace when ``APP_TRACE_DIR`` is set, else one that records nothing."""
        folder = os.environ.get(_ENV)
        if not folder:
            return cls()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{actor}-{os.getpid()}.tsv")
        return cls(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644))

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def mark(self, event: str, rid: str = "", detail: object = "") -> None:
        """Record ``event`` for request ``rid`` now (nothing when tracing is off)."""
        if self._fd is not None:
            os.write(self._fd, f"{time.monotonic():.6f}\t{event}\t{rid}\t{detail}\n".encode())
