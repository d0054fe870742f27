"""Retraction: when decode runs out of KV, whom to send back to the waiting queue; and
preemption by priority, the same move made for a more important waiting request.

A retracted request gives its memory back (its KV goes to the prefix cache first, so that its
recomputation is free while that is not evicted) and waits at the front of its priority rank in
the queue. The choice of victims is :func:`retraction_order` (with priorities, the least
important first). With priority scheduling, when
the head of the queue cannot be admitted, it preempts one running request a step whose priority
rank is worse than its own by more than --priority-scheduling-preemption-threshold (the least
important, then the newest: :meth:`Retraction.preemption_victim`).

With --enable-kv-swap a victim's whole KV (its cached prefix too: that part becomes evictable
once it leaves) is first copied to host memory (app/engine/kv_swap.py); when admitted again it
takes its cached prefix, the rest comes back from the copy and only its last token is computed.
A victim whose KV does not fit the host pool is recomputed as without swap.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from app.engine.kv_swap import HostKVSwap
from app.engine.memory import KVMemory
from app.engine.request import Request, Status
from app.engine.scheduling.events import SchedulerEvents
from app.engine.scheduling.reserve import AdmissionReserve
from app.engine.scheduling.running import RunningBatch
from app.engine.scheduling.waiting import Priorities, WaitingQueue


def retraction_order(running: Sequence[Request], priorities: Priorities = Priorities()) -> list[Request]:
    """Whom to retract first when decode runs out of KV: with priority scheduling the least
    important first; then fewest generated tokens (least work lost), then longest prompt (most
    memory back)."""
    return sorted(running, key=lambda r: (-priorities.rank(r), len(r.output_ids), -len(r.prompt_ids)))


class Retraction:
    """Makes room for the next decode step by retracting running requests."""

    def __init__(self, memory: KVMemory, waiting: WaitingQueue, reserve: AdmissionReserve, *,
                 preemption_threshold: int = 10, swap: HostKVSwap | None = None) -> None:
        self.memory = memory
        self.swap = swap  # --enable-kv-swap: a victim's KV goes to host memory, not recomputed
        self.waiting = waiting
        self.reserve = reserve  # admitted too boldly: a retraction sets it back
        self.count = 0  # decoding requests sent back to the queue for lack of KV
        # With priorities: a waiting request preempts a running one only past this rank gap
        self.preemption_threshold = preemption_threshold
        self.preemptions = 0  # running requests sent back to the queue for a more important one
        self.events = SchedulerEvents()  # told of each retraction (the Scheduler sets its own)

    def make_room(self, running: RunningBatch) -> bool:
        """Retract running requests until the others all have KV for one more token. False
        when even a single request cannot grow (the pool cannot hold it): the caller ends it."""
        victims = iter(retraction_order(running.reqs, self.waiting.priorities))
        while self.memory.available() < self.memory.slots_needed(running.reqs, [1] * len(running.reqs)):
            if len(running.reqs) == 1:
                return False
            self.retract(next(victims), running)
            running.flush_leavers()
        return True

    def retract(self, req: Request, running: RunningBatch) -> None:
        """Give a decoding request's memory back and queue it to be recomputed; admission
        goes back to its initial reserve."""
        self._send_back(req, running)
        self.events.retracted(req, time.time(), preempted=False)
        self.count += 1
        self.reserve.reset()

    def preemption_victim(self, running: Sequence[Request]) -> Request | None:
        """The running request the head of the waiting queue preempts: of those whose priority
        rank is worse than the head's by more than the threshold, the least important, then the
        newest; None without priorities or when there is none."""
        priorities, head = self.waiting.priorities, self.waiting.peek()
        if not priorities.enabled or head is None:
            return None
        rank = priorities.rank
        bar = rank(head) + self.preemption_threshold
        return max((r for r in reversed(running) if rank(r) > bar), key=lambda r: (rank(r), r.arrival_time),
                   default=None)

    def preempt(self, running: RunningBatch) -> bool:
        """Retract the :meth:`preemption_victim`, if any (leavers flushed); whether one was."""
        victim = self.preemption_victim(running.staying())
        if victim is None:
            return False
        self._send_back(victim, running)
        self.events.retracted(victim, time.time(), preempted=True)
        running.flush_leavers()
        self.preemptions += 1
        return True

    def _send_back(self, req: Request, running: RunningBatch) -> None:
        """Free a decoding request's memory and queue it again, to be recomputed (or, with
        swap, resumed from its KV's host copy)."""
        running.leave(req)
        if self.swap is not None:
            self.swap.swap_out(req)
        self.memory.release(req)
        req.status = Status.WAITING
        req.times_retracted += 1
        self.waiting.push_front(req)
