"""Scheduling policies, each a small replaceable piece: the waiting queue, the admission
check for a prefill step, and the choice of requests to retract when decode runs out of KV.

The backpressure work (queue limits, priorities, preemption thresholds) swaps these out;
the scheduler only calls the interfaces below.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from app.engine.request import Request


class WaitingQueue:
    """First come, first served; retracted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

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


@dataclass
class PrefillBudget:
    """What one prefill step may still take: tokens to compute, KV slots, request rows.

    ``kv_tokens`` starts as free + evictable slots minus a reserve for the future decode
    tokens of running requests (``new_token_ratio`` of what each may still generate). A
    request being prefilled must fit whole (rest of its prompt plus its own reserve), even
    when only one chunk is computed this step, so that admitted work can always finish.
    """

    compute_tokens: int  # --max-prefill-tokens left in this step
    kv_tokens: int
    rows: int  # request-table rows (and --max-running-requests) left
    chunk_size: int | None  # largest extend of one request in one step (None: no chunking)
    new_token_ratio: float
    page_size: int = 1
    taken: int = 0  # requests admitted to this step so far

    @classmethod
    def for_step(
        cls,
        *,
        max_prefill_tokens: int,
        chunk_size: int | None,
        available_kv: int,
        running: Sequence[Request],
        free_rows: int,
        new_token_ratio: float,
        page_size: int = 1,
    ) -> PrefillBudget:
        reserve = sum(int(r.remaining_new_tokens() * new_token_ratio) for r in running)
        # With chunking, a step computes at most one chunk of prompt tokens in all: only the
        # last request admitted to it can be cut short, so one request at a time is partial.
        compute = max_prefill_tokens if chunk_size is None else min(max_prefill_tokens, chunk_size)
        return cls(compute, available_kv - reserve, free_rows, chunk_size, new_token_ratio, page_size)

    def take(self, req: Request, *, needs_row: bool, alone: bool) -> int:
        """Tokens of ``req`` to compute this step, or 0 when it does not fit (nothing taken).

        ``alone``: nothing else runs or is admitted yet; the request then goes ahead even if
        its output reserve does not fit (progress over caution; retraction covers it).
        """
        todo = req.fill_len - req.kv_len
        if self.chunk_size is None:
            # Without chunking a prompt is computed whole; a long one may exceed the step's
            # token budget only when it is the step's first.
            n = todo if todo <= self.compute_tokens or self.taken == 0 else 0
        else:
            n = min(todo, self.compute_tokens)  # cut short only when it uses up the step
        if n <= 0 or (needs_row and self.rows <= 0):
            return 0
        # The request's pages may hold up to a page more than its tokens.
        kv_need = todo + int(req.remaining_new_tokens() * self.new_token_ratio) + self.page_size - 1
        if kv_need > self.kv_tokens and not (alone and todo + self.page_size - 1 <= self.kv_tokens):
            return 0
        self.compute_tokens -= n
        self.kv_tokens -= kv_need
        self.rows -= int(needs_row)
        self.taken += 1
        return n


def retraction_order(running: Sequence[Request]) -> list[Request]:
    """Whom to retract first when decode runs out of KV: fewest generated tokens (least work
    lost), then longest prompt (most memory back)."""
    return sorted(running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
