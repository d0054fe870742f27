"""The fixed limits every scheduling manager reads (from the engine's configuration)."""

from __future__ import annotations

from typing import NamedTuple


class SchedulerLimits(NamedTuple):
    context_len: int  # longest sequence (prompt + output)
    max_prefill_tokens: int  # prompt tokens one prefill step may compute
    chunk_size: int | None  # largest extend of one request in one step; None: no chunked prefill
    new_token_ratio: float  # share of each running request's remaining tokens kept free for its decode
    stream_interval: int = 1  # report incremental outputs every N tokens (the first at once)
    allow_auto_truncate: bool = False  # prompt + max_new_tokens over the context: cut there, not refused
    max_queued_requests: int | None = None  # waiting requests at most (an arrival past it: 503); None: unbounded
