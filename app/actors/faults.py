"""Test-only fault injection: ``APP_FAULT=<actor>:<point>:<action>[:<n>]``, read once at start.

Tests of crash handling need an actor to fail from the inside, at a chosen moment, in a real
server. The variable names the actor (``tokenizer``, ``scheduler`` or ``detokenizer``: the start
of its name), the point in its work, the action and the occurrence of the point at which the
fault fires (default 1: the first; the warm-up's work counts). It fires once. Unset (always,
outside tests), nothing is wrapped: :func:`around` hands back the function itself.

Points (one per actor, where its work is done):

- ``tokenizer:request``: one request tokenized (the warm-up sends four);
- ``scheduler:step``: one forward step, in the step's worker thread;
- ``detokenizer:output``: one step's outputs turned into text.

Actions:

- ``raise``: an :class:`InjectedFault` (a RuntimeError) from the point;
- ``exit``: the process exits at once with code ``FAULT_EXIT_CODE``, nothing said;
- ``hang``: the point never returns (it sleeps; the watchdog must notice);
- ``segfault``: a real SIGSEGV (faulthandler writes the native traceback);
- ``oom``: a ``torch.cuda.OutOfMemoryError`` (which a CPU build can raise too), the error a
  step that the engine recovers from raises.

Example: ``APP_FAULT=scheduler:step:raise:200`` makes the 200th step of the scheduler raise;
``APP_FAULT=detokenizer:output:hang:40`` makes the detokenizer hang on its 40th step output.
"""

from __future__ import annotations

import faulthandler
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

FAULT_ENV = "APP_FAULT"
ACTIONS = ("raise", "exit", "hang", "segfault", "oom")
POINTS = {"tokenizer": "request", "scheduler": "step", "detokenizer": "output"}  # the one point of each actor
FAULT_EXIT_CODE = 3  # the code an ``exit`` fault exits with

R = TypeVar("R")


class InjectedFault(RuntimeError):
    """The exception an injected ``raise`` fault raises."""


def _hang() -> None:
    while True:  # a sleep, not a busy loop: the test machine's cores stay free
        time.sleep(3600)


def _out_of_memory(message: str) -> None:
    import torch  # only the scheduler has an ``oom`` point: it has torch loaded

    raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. {message}")


@dataclass
class FaultPlan:
    """One fault to inject into this actor, at ``point``, on its ``at``-th occurrence."""

    point: str
    action: str
    at: int = 1
    seen: int = 0

    @classmethod
    def from_env(cls, actor: str, environ: Mapping[str, str] | None = None) -> FaultPlan | None:
        """The plan for ``actor`` in $APP_FAULT, or None (no fault for this actor). ValueError
        for a malformed value: a test that asked for a fault must not silently run without it."""
        value = (os.environ if environ is None else environ).get(FAULT_ENV, "")
        if not value:
            return None
        parts = value.split(":")
        if (len(parts) not in (3, 4) or parts[2] not in ACTIONS or (len(parts) == 4 and not parts[3].isdigit())
                or POINTS.get(parts[0]) != parts[1]):
            points = "|".join(f"{a}:{p}" for a, p in POINTS.items())
            raise ValueError(f"${FAULT_ENV} must be <{points}>:<{'|'.join(ACTIONS)}>[:<n>], got {value!r}")
        if not actor.startswith(parts[0]):
            return None
        return cls(parts[1], parts[2], int(parts[3]) if len(parts) == 4 else 1)

    def reach(self, point: str) -> None:
        """Call at ``point``: fires the fault on its ``at``-th occurrence."""
        if point != self.point:
            return
        self.seen += 1
        if self.seen != self.at:
            return
        where = f"{point} #{self.seen} ({FAULT_ENV})"
        if self.action == "raise":
            raise InjectedFault(f"injected fault: {where}")
        if self.action == "oom":
            _out_of_memory(f"Injected fault: {where}")
        if self.action == "exit":
            os._exit(FAULT_EXIT_CODE)
        if self.action == "segfault":
            faulthandler._sigsegv()  # type: ignore[attr-defined] # a real SIGSEGV, made for tests like this
        if self.action == "hang":
            _hang()


def around(plan: FaultPlan | None, point: str, function: Callable[..., R]) -> Callable[..., R]:
    """``function``, reaching ``point`` of ``plan`` before each call; itself when there is no plan."""
    if plan is None or plan.point != point:
        return function

    def faulty(*args: Any) -> R:
        plan.reach(point)
        return function(*args)

    return faulty
