"""Prefill steps: which waiting requests a step admits, with how many prompt tokens each.

A prefill (EXTEND) step takes requests from the front of the waiting queue while they fit the
step's :class:`PrefillBudget` (tokens to compute, KV slots, request rows). Admission gives a
request its longest cached prefix (``KVMemory.admit``: those tokens are not computed again).
With chunked prefill a long prompt is computed over several steps; only the last request a
step admits can be cut short, so at most one request at a time carries a partial prompt into
the next step (``PrefillManager.partial``). Each chunk's KV goes to the prefix cache at once.

The reserve kept for the running requests' future tokens is the budget's; its share (the
new-token ratio) adapts over steps and retractions (reserve.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from app.engine.forward_batch import ForwardMode
from app.engine.kv_swap import HostKVSwap
from app.engine.memory import KVMemory
from app.engine.request import Request, Status
from app.engine.scheduling.batch import ScheduledBatch
from app.engine.scheduling.events import SchedulerEvents
from app.engine.scheduling.limits import SchedulerLimits
from app.engine.scheduling.reserve import AdmissionReserve
from app.engine.scheduling.running import RunningBatch
from app.engine.scheduling.waiting import WaitingQueue


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


class PrefillManager:
    """Schedules prefill steps from the waiting queue; owns the one partial prompt."""

    def __init__(self, limits: SchedulerLimits, memory: KVMemory, waiting: WaitingQueue, reserve: AdmissionReserve,
                 swap: HostKVSwap | None = None) -> None:
        self.limits = limits
        self.swap = swap  # --enable-kv-swap: a swapped-out request's KV comes back at admission
        self.memory = memory
        self.waiting = waiting
        self.reserve = reserve  # the share of running requests' remaining tokens kept free
        self.partial: Request | None = None  # the one request with a partial prompt
        self.events = SchedulerEvents()  # told of each admission (the Scheduler sets its own)

    def has_work(self) -> bool:
        """Whether a prompt waits or is part-way in."""
        return self.partial is not None or bool(self.waiting)

    def schedule(self, running: RunningBatch, in_flight: Sequence[Request] = ()) -> ScheduledBatch | None:
        """The next prefill step, or None. ``in_flight``: requests whose prefill step has not
        been processed yet (they join the running batch then), budgeted as running."""
        if self.partial is None and not self.waiting:
            return None
        if self.waiting.longest_prefix_first:
            self.waiting.order_for_prefill(self._cached_prefix_len)
        running_reqs = [*running.staying(), *in_flight]
        budget = PrefillBudget.for_step(
            max_prefill_tokens=self.limits.max_prefill_tokens,
            chunk_size=self.limits.chunk_size,
            available_kv=self.memory.available(),
            running=running_reqs,
            free_rows=self.memory.table.num_free(),
            new_token_ratio=self.reserve.ratio(),
            page_size=self.memory.page_size,
        )
        reqs: list[Request] = []
        lens: list[int] = []
        if self.partial is not None:
            n = budget.take(self.partial, needs_row=False, alone=not running_reqs)
            if n == 0:
                return None
            reqs.append(self.partial)
            lens.append(n)
            self.partial = None
        while self.waiting and (self.limits.chunk_size is None or budget.compute_tokens > 0):
            req = self.waiting.peek()
            assert req is not None
            evictable = self.memory.cache.evictable_size()
            if not self.memory.admit(req):
                break
            budget.kv_tokens -= evictable - self.memory.cache.evictable_size()  # now locked by req
            restored = -1  # slots a swapped-out request's KV took coming back (-1: none came back)
            if self.swap is not None and self.swap.holds(req):
                restored = self.swap.swap_in(req)  # its KV back: only its last token is computed
                budget.kv_tokens -= max(restored, 0)
            n = budget.take(req, needs_row=True, alone=not running_reqs and not reqs)
            if n == 0:
                self.memory.release(req)  # a KV copied back goes to the prefix cache; the host copy stays
                break
            if self.swap is not None and restored >= 0:
                self.swap.resumed(req)
            elif self.swap is not None:
                self.swap.recomputed(req)
            self.waiting.pop()
            if req.times_retracted == 0 and req.kv_len and not req.output_ids:
                req.cached_tokens = req.kv_len
            req.status = Status.PREFILLING
            self.events.admitted(req, time.time())
            reqs.append(req)
            lens.append(n)
        if not reqs:
            return None
        samples = [r.kv_len + n == r.fill_len for r, n in zip(reqs, lens)]
        partial = [r for r, done in zip(reqs, samples) if not done]
        assert len(partial) <= 1, "at most one request carries a partial prompt"
        self.partial = partial[0] if partial else None
        return ScheduledBatch(ForwardMode.EXTEND, reqs, lens, samples)

    def _cached_prefix_len(self, req: Request) -> int:
        """Tokens of ``req`` admission would take from the prefix cache (as KVMemory.admit matches)."""
        return self.memory.cache.cached_prefix_len(req.fill_ids[:-1])

    def cache_chunks(self, batch: ScheduledBatch) -> None:
        """After a step: share each chunk just computed (a prompt not done yet) through the
        prefix cache; the request goes on with its next chunk."""
        for req, done in zip(batch.reqs, batch.samples):
            if not done and req.status is Status.PREFILLING:
                self.memory.cache_progress(req)

    def forget(self, req: Request) -> None:
        """``req`` ended: it carries no partial prompt any more."""
        if self.partial is req:
            self.partial = None
