"""Asking actors that still run for what only they know, before a watchdog or SIGQUIT dump.

A dead actor's story is in its failure report and exit status; a live one (stalled, or about
to be stopped by a SIGQUIT) can still tell more, if it answers:

- ``SIGUSR2`` (native_traces.py): faulthandler writes the Python stack of every thread of the
  process into its trace file, from a C signal handler, so even a process whose Python code is
  blocked answers (the scheduler's hung step shows in its worker thread's stack);
- ``SIGUSR1`` (:data:`VIEW_SIGNAL`): the scheduler writes its own view (its batch, queue, KV
  pool, recent requests) as an actor dump (scheduler_dump.py), which the supervisor merges.

A stopped process answers neither: the wait is bounded (``EVIDENCE_WAIT_S``), and the dump is
written with what came. Without ``--crash-dump-folder`` the stacks go to the actors' stderr
(the log) and no view is asked for.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from pathlib import Path

import trio

from app.actors.process import ActorProcess
from app.observability.crash_dump import find_actor_dumps
from app.observability.native_traces import STACKS_SIGNAL, native_trace_path

VIEW_SIGNAL = signal.SIGUSR1  # "write your crash view now, and go on": the scheduler's
EVIDENCE_WAIT_S = 1.0  # at most this long for the answers (a stopped process gives none)
_POLL_S = 0.02


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _signal(actor: ActorProcess, sig: signal.Signals) -> bool:
    if actor.popen.poll() is not None:
        return False
    try:
        os.kill(actor.pid, sig)
    except ProcessLookupError:
        return False
    return True


async def gather_evidence(folder: str | None, actors: Sequence[ActorProcess], stacks_of: Sequence[ActorProcess],
                          *, wait_s: float = EVIDENCE_WAIT_S) -> dict[str, bool]:
    """Ask ``stacks_of`` for their stacks and every running scheduler of ``actors`` for its
    view; wait up to ``wait_s`` for the answers. Returns which actors answered (by name: stacks
    ``<name>``, views ``<name>:view``); without a folder, asks for stacks only, waits for none."""
    answers: dict[str, bool] = {}
    stacks: dict[str, tuple[Path, int]] = {}
    for actor in stacks_of:
        path = native_trace_path(folder, actor.name, actor.pid) if folder is not None else None
        before = _size(path) if path is not None else 0
        if _signal(actor, STACKS_SIGNAL) and path is not None:
            stacks[actor.name] = (path, before)
    if folder is None:
        return answers
    views: dict[str, tuple[ActorProcess, int]] = {}
    for actor in actors:
        if actor.name.startswith("scheduler"):
            before_views = len(find_actor_dumps(folder, actor.name, actor.pid))
            if _signal(actor, VIEW_SIGNAL):
                views[actor.name] = (actor, before_views)
    with trio.move_on_after(wait_s):
        while True:
            for name, (path, before) in stacks.items():
                answers[name] = _size(path) > before
            for name, (actor, before_views) in views.items():
                answers[f"{name}:view"] = len(find_actor_dumps(folder, actor.name, actor.pid)) > before_views
            if all(answers.values()):
                break
            await trio.sleep(_POLL_S)
    return answers
