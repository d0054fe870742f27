"""The waiting queue and request admission: which requests can ever run, and in what order
the waiting ones are offered to the next prefill step.

This is where a bound on the queue, an ordering policy (fcfs, longest prefix match),
priorities belong (timeouts are deadlines.py's): :meth:`WaitingQueue.check` refuses what can never run,
and the queue's order is the order prefill.py admits in.

The order is one key, (priority rank, cached prefix, arrival): the rank first (all 0 without
priorities), then, with ``--schedule-policy lpm``, the longest prefix already in the radix cache
(its tokens are not computed again, and admitting them together keeps it from being evicted),
then arrival. fcfs keeps the queue as it arrives; lpm re-sorts it whenever a prefill step is
scheduled (:meth:`WaitingQueue.order_for_prefill`; a retracted request, whose KV went to the
cache, usually sorts first of its rank anyway), unless more than ``LPM_MAX_WAITING`` requests wait:
then it falls back to the queue's order, as SGLang does, since every sort walks the radix
tree once per waiting request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

from app.engine.request import Request
from app.ipc.messages import QUEUE_FULL_MESSAGE

LPM_MAX_WAITING = 128  # more waiting requests than this: lpm orders as fcfs (SGLang's limit)

# SGLang's wording, so that clients matching on it keep working.
EVICTED_BY_PRIORITY = "The request is aborted by a higher priority request."


class AdmissionError(ValueError):
    """A request the engine can never serve (too long for the context or the KV pool)."""


class QueueFullError(AdmissionError):
    """The queue already holds --max-queued-requests: refused now (503), it may succeed later.

    The message is SGLang's, so clients that match on it keep working.
    """

    def __init__(self) -> None:
        super().__init__(QUEUE_FULL_MESSAGE)


class Priorities(NamedTuple):
    """SGLang's priority scheduling: --enable-priority-scheduling, and which end of the integer
    ``priority`` goes first (--schedule-low-priority-values-first; by default the larger value)."""

    enabled: bool = False
    low_values_first: bool = False

    def rank(self, req: Request) -> int:
        """Where ``req`` stands by priority: a smaller rank is more important (all 0 when off).
        The queue's order is (rank, arrival): an ordering policy sorts within a rank."""
        if not self.enabled:
            return 0
        return req.priority if self.low_values_first else -req.priority


class WaitingQueue:
    """In (priority rank, arrival) order: first come, first served within a rank (every request
    has rank 0 without priorities); retracted requests go back to the front of their rank."""

    def __init__(self, *, context_len: int, kv_capacity: int, allow_auto_truncate: bool = False,
                 max_queued: int | None = None, priorities: Priorities = Priorities(), policy: str = "fcfs") -> None:
        self.priorities = priorities
        self.longest_prefix_first = policy == "lpm"  # --schedule-policy lpm (see the module doc)
        self.context_len = context_len
        # --max-queued-requests: an arrival finding this many waiting is refused; None: unbounded
        self.max_queued = max_queued
        # --allow-auto-truncate: prompt + max_new_tokens over the context is cut there, not refused
        self.allow_auto_truncate = allow_auto_truncate
        self.kv_capacity = kv_capacity  # KV slots of the whole pool: a prompt must fit with one token more
        self._queue: deque[Request] = deque()

    def check(self, req: Request) -> Request | None:
        """Raise AdmissionError for a request that can never run, whatever else is running, and
        QueueFullError for one arriving at a full queue (retracted requests return to the queue
        without this check: they were admitted once). With priorities, an arrival more important
        than the least important queued request is let in: that one is returned, for the caller
        to end (503, :data:`EVICTED_BY_PRIORITY`) before queueing ``req``."""
        prompt_len = len(req.prompt_ids)
        if prompt_len == 0:
            raise AdmissionError("the prompt is empty: at least one token is needed")
        if prompt_len >= self.context_len:
            raise AdmissionError(
                f"The input ({prompt_len} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)."
            )
        overflow = None if self.allow_auto_truncate else req.params.context_overflow(prompt_len, self.context_len)
        if overflow is not None:
            raise AdmissionError(overflow)
        if prompt_len + 1 > self.kv_capacity:
            raise AdmissionError(f"The input ({prompt_len} tokens) does not fit in the KV cache ({self.kv_capacity} tokens).")
        if self.max_queued is not None and len(self._queue) >= self.max_queued:
            victim = self.least_important()
            if victim is None or self.priorities.rank(victim) <= self.priorities.rank(req):
                raise QueueFullError()
            return victim
        return None

    def least_important(self) -> Request | None:
        """The queued request a more important arrival evicts from a full queue: the largest
        rank, and of those the newest arrival (SGLang's rule); None without priorities."""
        if not self.priorities.enabled or not self._queue:
            return None
        rank = self.priorities.rank
        return max(reversed(self._queue), key=lambda r: (rank(r), r.arrival_time))

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def push(self, req: Request) -> None:
        """Queue an arrival behind every request of its rank or a more important one."""
        queue, rank = self._queue, self.priorities.rank
        if not queue or rank(queue[-1]) <= rank(req):  # always, without priorities
            queue.append(req)
            return
        queue.insert(next(i for i, r in enumerate(queue) if rank(r) > rank(req)), req)

    def push_front(self, req: Request) -> None:
        """Queue a retracted request ahead of every request of its rank."""
        queue, rank = self._queue, self.priorities.rank
        if not queue or rank(queue[0]) >= rank(req):  # always, without priorities
            queue.appendleft(req)
            return
        queue.insert(next((i for i, r in enumerate(queue) if rank(r) >= rank(req)), len(queue)), req)

    def order_for_prefill(self, cached_prefix_len: Callable[[Request], int]) -> None:
        """With lpm and at most LPM_MAX_WAITING waiting: sort the queue by (priority rank, longest
        ``cached_prefix_len`` first); a stable sort, so arrival order breaks ties. Else nothing."""
        queue = self._queue
        if not self.longest_prefix_first or len(queue) < 2 or len(queue) > LPM_MAX_WAITING:
            return
        rank = self.priorities.rank
        self._queue = deque(sorted(queue, key=lambda r: (rank(r), -cached_prefix_len(r))))

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, req: Request) -> bool:
        try:
            self._queue.remove(req)
        except ValueError:
            return False
        return True
