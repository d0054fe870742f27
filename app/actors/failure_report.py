"""How a failing actor tells the supervisor why, before it exits: one marked line on its stderr.

An exit code says little: a scheduler whose step raised exits 1 like any other, and one that
got an unrequested SIGTERM exits 0 like a detokenizer whose input simply ended. So a child
that fails writes one line, ``APP_FAILURE_REPORT {json}``, on the stderr the supervisor
already drains: the exception with its full traceback, the signal that stopped it, or the
peer it followed. The supervisor keeps these lines out of the log (the child logs the same
failure in words), attaches them to the :class:`~app.actors.process.ActorDied` it reports,
and prefers an actor that reported a failure of its own over one that only followed
(:func:`is_own_failure`), so the root cause is what the client and the crash dump name.

Kinds (``report["kind"]``): ``exception`` (``type``, ``message``, ``traceback``),
``signal`` (``signal``: it was asked to stop by a signal the supervisor may not have sent),
``peer_gone`` (``message``: it stopped because a peer died; a consequence, never a cause).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Literal, TextIO

import trio

from app.observability.native_traces import STACKS_SIGNAL

REPORT_PREFIX = "APP_FAILURE_REPORT "
OWN_FAILURE_KINDS = ("exception", "signal")  # kinds that make an actor a root-cause candidate
MAX_TRACEBACK_CHARS = 64_000  # one stderr line: a recursion error's traceback stays readable


class QuitSignal(Exception):
    """SIGQUIT reached an actor: it stops as failed (exit code 1), having said so."""


def report_sigquit() -> QuitSignal:
    """SIGQUIT reached this actor: its stacks go to its trace file (native_traces.py), a
    ``signal`` report to the supervisor (a failure of its own); returns the exception that
    stops it, for the caller to raise."""
    os.kill(os.getpid(), STACKS_SIGNAL)
    send_report({"kind": "signal", "signal": "SIGQUIT"})
    return QuitSignal("SIGQUIT received")


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def failure_kind(exc: BaseException) -> Literal["cancelled", "peer_gone", "exception"]:
    """What ended an actor's trio run: only cancellations (a requested stop), only broken
    channels (a PeerDiedError, or a channel its peer closed: it followed another's failure),
    or an exception of its own."""
    leaves = [leaf for leaf in _leaves(exc) if not isinstance(leaf, trio.Cancelled)]
    if not leaves:
        return "cancelled"
    if all(isinstance(leaf, trio.BrokenResourceError) for leaf in leaves):
        return "peer_gone"
    return "exception"


def root_exception(exc: BaseException) -> BaseException:
    """The exception that matters inside trio's groups: the first that is neither a
    cancellation nor a broken channel (``exc`` itself when there is none)."""
    for leaf in _leaves(exc):
        if not isinstance(leaf, (trio.Cancelled, trio.BrokenResourceError)):
            return leaf
    return exc


def exception_report(exc: BaseException) -> dict[str, Any]:
    """The report of ``exc``: the type and message of its root exception, and the whole
    traceback (chained exceptions and groups included)."""
    text = "".join(traceback.format_exception(exc))
    if len(text) > MAX_TRACEBACK_CHARS:
        text = "…" + text[-MAX_TRACEBACK_CHARS:]
    root = root_exception(exc)
    return {"kind": "exception", "type": type(root).__qualname__, "message": str(root)[:2000], "traceback": text}


def send_report(report: dict[str, Any], stream: TextIO | None = None) -> None:
    """Write ``report`` (a kind and its fields) as one marked stderr line, flushed."""
    stream = stream or sys.stderr
    line = REPORT_PREFIX + json.dumps({**report, "time": time.time()}, default=str) + "\n"
    stream.write(line)
    stream.flush()


def parse_report(line: str) -> dict[str, Any] | None:
    """The report a stderr line carries, or None for an ordinary line (or a damaged report)."""
    if not line.startswith(REPORT_PREFIX):
        return None
    try:
        report = json.loads(line[len(REPORT_PREFIX):])
    except ValueError:
        return None
    return report if isinstance(report, dict) and "kind" in report else None


def is_own_failure(report: dict[str, Any] | None) -> bool:
    """Whether ``report`` says the actor failed by itself (not by following a peer)."""
    return report is not None and report.get("kind") in OWN_FAILURE_KINDS
