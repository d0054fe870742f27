"""faulthandler in every process, writing where the crash-dump tooling finds it.

A segfault, an abort or a bus error kills a process before any Python ``except`` runs; only
:mod:`faulthandler` (a signal handler in C) can still print the Python stack of every thread.
With ``--crash-dump-folder DIR`` each process (the ingress and every actor) writes those
tracebacks to ``DIR/faulthandler_<actor>_<pid>.log``; the supervisor's crash dump quotes the
file of the actor that died and names its path, and ``tools/postmortem.py`` prints it. A
process that ends without writing anything removes its empty file (the supervisor removes
those of actors that were killed). Without a folder, the tracebacks go to stderr, which the
supervisor keeps the end of.

``SIGUSR2`` makes a process write the stacks of all its threads to the same place and go on
running: how a supervisor that suspects a hang (a watchdog) asks for them.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

STACKS_SIGNAL = signal.SIGUSR2  # "write your Python stacks", for a watchdog or an operator
MAX_TRACE_CHARS = 64_000  # what a dump quotes of one file (its end)


def native_trace_path(folder: str | Path, actor: str, pid: int) -> Path:
    """Where the process ``pid`` (``actor``: ``ingress``, ``scheduler_TP0``…) writes its tracebacks."""
    return Path(folder) / f"faulthandler_{actor}_{pid}.log"


@dataclass(frozen=True)
class NativeTraces:
    """This process's trace file, open for as long as faulthandler may write to it."""

    path: Path
    file: TextIO


def enable_native_traces(folder: str | Path | None, actor: str) -> NativeTraces | None:
    """Enable faulthandler (and the stacks signal) for this process, into its file in
    ``folder``; on stderr (and None returned) when ``folder`` is None or cannot be written.
    Keep the result for the life of the process."""
    traces: NativeTraces | None = None
    if folder is not None:
        path = native_trace_path(folder, actor, os.getpid())
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            traces = NativeTraces(path, os.fdopen(descriptor, "w"))
        except OSError:
            traces = None
    if traces is None:
        faulthandler.enable(all_threads=True)
        faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)
    else:
        faulthandler.enable(file=traces.file, all_threads=True)
        faulthandler.register(STACKS_SIGNAL, file=traces.file, all_threads=True, chain=False)
    return traces


def remove_if_empty(path: Path) -> None:
    """Delete a trace file that holds nothing (its process ended without a fault)."""
    try:
        if path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass


def remove_empty_traces(folder: str | Path | None, processes: list[tuple[str, int]]) -> None:
    """Remove the empty trace files of stopped processes (``(actor, pid)``): those killed
    before they could remove their own."""
    if folder is not None:
        for actor, pid in processes:
            remove_if_empty(native_trace_path(folder, actor, pid))


def close_native_traces(traces: NativeTraces | None) -> None:
    """At a clean exit: stop writing, and remove the file if nothing was written."""
    if traces is None:
        return
    faulthandler.disable()
    faulthandler.unregister(STACKS_SIGNAL)
    traces.file.close()
    remove_if_empty(traces.path)


def read_native_trace(path: Path) -> str | None:
    """The end of a trace file, or None when there is none or it is empty."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    return text[-MAX_TRACE_CHARS:] or None


@contextmanager
def native_traces(folder: str | Path | None, actor: str) -> Iterator[NativeTraces | None]:
    """:func:`enable_native_traces` for the block, :func:`close_native_traces` after it."""
    traces = enable_native_traces(folder, actor)
    try:
        yield traces
    finally:
        close_native_traces(traces)
