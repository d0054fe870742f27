"""Request timeouts: the waiting timeout (in the queue until the prefill starts) and the request
timeout (from arrival to the end), each the smaller of the server's flag and the request's own.

Deadlines are wall-clock times (``time.time()``): a request's ``arrival_time`` is stamped by the
HTTP layer in another process, so the deadline counts the tokenizer's time too. They sit in one
heap, nearest first, so the scheduler's step compares the nearest one with the clock once, and
only when some deadline is pending: with no timeout set the heap stays empty and the step reads
one empty list. Entries of requests that ended before their deadline are dropped when they
come up (or when the heap is compacted), never searched for.
"""

from __future__ import annotations

import enum
import heapq
import time
from itertools import count

from app.engine.request import Request, Status


class TimeoutKind(enum.Enum):
    WAITING = "waiting"
    REQUEST = "request"


class Deadlines:
    """Every pending deadline, nearest first (see the module docstring)."""

    def __init__(self, *, waiting_timeout: float | None, request_timeout: float | None) -> None:
        self.waiting_timeout = waiting_timeout  # the server's cap; None: none unless the request sets one
        self.request_timeout = request_timeout
        # (deadline, tie-break, kind, request); read by Scheduler.step as ``heap and heap[0][0] <= now``
        self.heap: list[tuple[float, int, TimeoutKind, Request]] = []
        self._order = count()
        self._compact_at = 64  # entries of ended requests are filtered out when the heap reaches this

    def track(self, req: Request) -> None:
        """Record ``req``'s deadlines (none when neither the server nor the request sets one)."""
        waiting = _smaller(req.params.waiting_timeout, self.waiting_timeout)
        total = _smaller(req.params.timeout, self.request_timeout)
        if waiting is None and total is None:
            return
        if len(self.heap) >= self._compact_at:
            self.heap = [entry for entry in self.heap if entry[3].status is not Status.FINISHED]
            heapq.heapify(self.heap)
            self._compact_at = max(64, 2 * len(self.heap))
        arrival = req.arrival_time or time.time()  # 0: not stamped (a bare Request): from now
        if waiting is not None:
            heapq.heappush(self.heap, (arrival + waiting, next(self._order), TimeoutKind.WAITING, req))
        if total is not None:
            heapq.heappush(self.heap, (arrival + total, next(self._order), TimeoutKind.REQUEST, req))

    def nearest(self) -> float | None:
        """The nearest pending deadline (it may belong to a request that has ended since)."""
        return self.heap[0][0] if self.heap else None

    def expired(self, now: float) -> list[tuple[Request, str]]:
        """Pop every deadline up to ``now``; return the requests to abort, each with the message
        that names its timeout. A waiting deadline no longer applies once the prefill started
        (a retracted request back in the queue has started), nor does any to an ended request."""
        heap = self.heap
        ended: list[tuple[Request, str]] = []
        while heap and heap[0][0] <= now:
            _, _, kind, req = heapq.heappop(heap)
            if req.status is Status.FINISHED or any(r is req for r, _ in ended):
                continue
            if kind is TimeoutKind.WAITING:
                if req.status is Status.WAITING and req.times_retracted == 0:
                    limit = _smaller(req.params.waiting_timeout, self.waiting_timeout)
                    ended.append((req, f"the request waited longer than the waiting timeout ({limit} s)"))
            else:
                limit = _smaller(req.params.timeout, self.request_timeout)
                ended.append((req, f"the request took longer than the request timeout ({limit} s)"))
        return ended


def _smaller(requested: float | None, cap: float | None) -> float | None:
    """The request's own timeout capped by the server's; either alone when the other is None."""
    if requested is None:
        return cap
    return requested if cap is None else min(requested, cap)
