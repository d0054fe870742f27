"""The waiting queue and request admission: which requests can ever run, and in what order
the waiting ones are offered to the next prefill step.

This is where a bound on the queue, an ordering policy (fcfs, longest prefix match),
priorities belong (timeouts are deadlines.py's): :meth:`WaitingQueue.check` refuses what can never run,
and the queue's order is the order prefill.py admits in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from app.engine.request import Request


class AdmissionError(ValueError):
    """A request the engine can never serve (too long for the context or the KV pool)."""


class QueueFullError(AdmissionError):
    """The queue already holds --max-queued-requests: refused now (503), it may succeed later.

    The message is SGLang's, so clients that match on it keep working.
    """

    def __init__(self) -> None:
        super().__init__("The request queue is full.")


class WaitingQueue:
    """First come, first served; retracted requests go back to the front."""

    def __init__(self, *, context_len: int, kv_capacity: int, allow_auto_truncate: bool = False,
                 max_queued: int | None = None) -> None:
        self.context_len = context_len
        # --max-queued-requests: an arrival finding this many waiting is refused; None: unbounded
        self.max_queued = max_queued
        # --allow-auto-truncate: prompt + max_new_tokens over the context is cut there, not refused
        self.allow_auto_truncate = allow_auto_truncate
        self.kv_capacity = kv_capacity  # KV slots of the whole pool: a prompt must fit with one token more
        self._queue: deque[Request] = deque()

    def check(self, req: Request) -> None:
        """Raise AdmissionError for a request that can never run, whatever else is running, and
        QueueFullError for one arriving at a full queue (retracted requests return to the queue
        without this check: they were admitted once)."""
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
            raise QueueFullError()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def push(self, req: Request) -> None:
        self._queue.append(req)

    def push_front(self, req: Request) -> None:
        self._queue.appendleft(req)

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
