"""The fixed limits every scheduling manager reads (from the engine's configuration)."""

from __future__ import annotations

from typing import NamedTuple


class SchedulerLimits(NamedTuple):
    context_len: int  # longest sequence (prompt + output)
    max_prefill_tokens: int  # prompt tokens one prefill step may compute
    chunk_size: int | None  # largest extend of one request in one step; None: no chunked prefill
    stream_interval: int = 1  # report incremental outputs every N tokens (the first at once)
    allow_auto_truncate: bool = False  # prompt + max_new_tokens over the context: cut there, not refused
    max_queued_requests: int | None = None  # waiting requests at most (an arrival past it: 503); None: unbounded
    schedule_conservativeness: float = 1.0  # scales the admission reserve's shares (reserve.py)
    schedule_policy: str = "fcfs"  # the waiting queue's order: fcfs or lpm (waiting.py)
    # --enable-priority-scheduling, --schedule-low-priority-values-first (waiting.py's Priorities)
    priority_scheduling: bool = False
    low_priority_values_first: bool = False
    preemption_threshold: int = 10  # --priority-scheduling-preemption-threshold: a larger gap preempts
    host_kv_pool_tokens: int = 0  # --enable-kv-swap's host pool of preempted requests' KV (0: swap off)
