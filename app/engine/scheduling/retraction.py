"""Retraction: when decode runs out of KV, whom to send back to the waiting queue.

A retracted request gives its memory back (its KV goes to the prefix cache first, so that its
recomputation is free while that is not evicted) and waits at the front of the queue. The
choice of victims is :func:`retraction_order`; preemption by priority and swapping KV out to
host memory instead of recomputing it belong here too.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.engine.memory import KVMemory
from app.engine.request import Request, Status
from app.engine.scheduling.reserve import AdmissionReserve
from app.engine.scheduling.running import RunningBatch
from app.engine.scheduling.waiting import WaitingQueue


def retraction_order(running: Sequence[Request]) -> list[Request]:
    """Whom to retract first when decode runs out of KV: fewest generated tokens (least work
    lost), then longest prompt (most memory back)."""
    return sorted(running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))


class Retraction:
    """Makes room for the next decode step by retracting running requests."""

    def __init__(self, memory: KVMemory, waiting: WaitingQueue, reserve: AdmissionReserve) -> None:
        self.memory = memory
        self.waiting = waiting
        self.reserve = reserve  # admitted too boldly: a retraction sets it back
        self.count = 0  # decoding requests sent back to the queue for lack of KV

    def make_room(self, running: RunningBatch) -> bool:
        """Retract running requests until the others all have KV for one more token. False
        when even a single request cannot grow (the pool cannot hold it): the caller ends it."""
        victims = iter(retraction_order(running.reqs))
        while self.memory.available() < self.memory.slots_needed(running.reqs, [1] * len(running.reqs)):
            if len(running.reqs) == 1:
                return False
            self.retract(next(victims), running)
            running.flush_leavers()
        return True

    def retract(self, req: Request, running: RunningBatch) -> None:
        """Give a decoding request's memory back and queue it to be recomputed; admission
        goes back to its initial reserve."""
        running.leave(req)
        self.memory.release(req)
        req.status = Status.WAITING
        req.times_retracted += 1
        self.count += 1
        self.reserve.reset()
        self.waiting.push_front(req)
