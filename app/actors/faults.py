"""Test-only fault injection: ``APP_FAULT=<actor>:<point>:<action>[:<n>]``, read once at start.

Tests of crash handling need an actor to fail from the inside, at a chosen moment, in a real
server. The variable names the actor (``scheduler``; the start of its name), the point in its
work (``step``: a forward step, in the step's worker thread), the action (``raise``: a
RuntimeError) and the occurrence of the point at which the fault fires (default 1: the first;
the warm-up's steps count). It fires once. Unset (always, outside tests), nothing is wrapped:
:func:`around` hands back the function itself.

Example: ``APP_FAULT=scheduler:step:raise:200`` makes the 200th step of the scheduler raise.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

FAULT_ENV = "APP_FAULT"
ACTIONS = ("raise",)

R = TypeVar("R")


class InjectedFault(RuntimeError):
    """The exception an injected ``raise`` fault raises."""


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
        if len(parts) not in (3, 4) or parts[2] not in ACTIONS or (len(parts) == 4 and not parts[3].isdigit()):
            raise ValueError(f"${FAULT_ENV} must be <actor>:<point>:<{'|'.join(ACTIONS)}>[:<n>], got {value!r}")
        if not actor.startswith(parts[0]):
            return None
        return cls(parts[1], parts[2], int(parts[3]) if len(parts) == 4 else 1)

    def reach(self, point: str) -> None:
        """Call at ``point``: fires the fault on its ``at``-th occurrence."""
        if point != self.point:
            return
        self.seen += 1
        if self.seen == self.at and self.action == "raise":
            raise InjectedFault(f"injected fault: {point} #{self.seen} ({FAULT_ENV})")


def around(plan: FaultPlan | None, point: str, function: Callable[..., R]) -> Callable[..., R]:
    """``function``, reaching ``point`` of ``plan`` before each call; itself when there is no plan."""
    if plan is None or plan.point != point:
        return function

    def faulty(*args: Any) -> R:
        plan.reach(point)
        return function(*args)

    return faulty
