"""What happens to requests and batches in the scheduler, told to observers as it happens.

The scheduler actor's request logs, periodic scheduler lines, metrics and traces all need the
same moments: a request admitted to its first prefill (its queue time), each batch launched
and processed (its size, tokens, the time it took), a request's first token, its end, and a
retraction or preemption. The scheduler calls one :class:`SchedulerEvents` object at each of
them; :class:`EventFanOut` passes them to several observers. The base class does nothing, so
an observer overrides only what it needs, and a scheduler without observers pays one method
call per event.

Times are ``time.time()`` (wall clock, as ``Request.arrival_time``), taken once per event.
Observers must not change the scheduler's state and must not raise: an exception here would
fail the step (the scheduler actor's observers catch their own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.engine.request import Request
from app.engine.scheduling.batch import ScheduledBatch


class SchedulerEvents:
    """The moments the scheduler reports; every method does nothing unless overridden."""

    def admitted(self, req: Request, now: float) -> None:
        """``req`` left the waiting queue for a prefill (again, after a retraction:
        ``req.times_retracted`` > 0); ``req.cached_tokens`` is set."""

    def batch_launched(self, batch: ScheduledBatch, now: float) -> None:
        """A step's batch went to the device: a prefill (``ForwardMode.EXTEND``: ``extend_lens``
        tokens of each request, ``samples`` marks those whose prompt completes) or a decode."""

    def batch_processed(self, batch: ScheduledBatch, launched_at: float, now: float) -> None:
        """The batch's tokens were read and applied (its requests' first tokens and finishes
        have been reported just before this)."""

    def first_token(self, req: Request, now: float) -> None:
        """``req`` has its first output token."""

    def finished(self, req: Request, now: float) -> None:
        """``req`` ended (``req.finish`` says how: stop, length, or abort with its status)."""

    def retracted(self, req: Request, now: float, *, preempted: bool) -> None:
        """``req`` went back to the waiting queue: for lack of KV, or ``preempted`` by a more
        important waiting request."""


class EventFanOut(SchedulerEvents):
    """Passes every event to each of ``observers``, in order."""

    def __init__(self, observers: Sequence[SchedulerEvents]) -> None:
        self.observers = tuple(observers)

    def admitted(self, req: Request, now: float) -> None:
        for observer in self.observers:
            observer.admitted(req, now)

    def batch_launched(self, batch: ScheduledBatch, now: float) -> None:
        for observer in self.observers:
            observer.batch_launched(batch, now)

    def batch_processed(self, batch: ScheduledBatch, launched_at: float, now: float) -> None:
        for observer in self.observers:
            observer.batch_processed(batch, launched_at, now)

    def first_token(self, req: Request, now: float) -> None:
        for observer in self.observers:
            observer.first_token(req, now)

    def finished(self, req: Request, now: float) -> None:
        for observer in self.observers:
            observer.finished(req, now)

    def retracted(self, req: Request, now: float, *, preempted: bool) -> None:
        for observer in self.observers:
            observer.retracted(req, now, preempted=preempted)


def add_observer(scheduler: Any, observer: SchedulerEvents) -> None:
    """Make ``observer`` one more of ``scheduler.events``' observers, keeping those it has."""
    current = scheduler.events
    if isinstance(current, EventFanOut):
        observers: tuple[SchedulerEvents, ...] = current.observers
    elif type(current) is SchedulerEvents:  # the scheduler's default: nobody listens
        observers = ()
    else:
        observers = (current,)
    scheduler.events = EventFanOut([*observers, observer])
