"""The scheduler's metrics (--enable-metrics): what its events tell, and what its state shows.

:class:`SchedulerMetrics` observes the engine scheduler (events.py): a request's first admission
gives its queue time, each processed batch its step time (prefill or decode) and its sampled
tokens, each retraction a preemption or a retraction for lack of KV. Those are recorded in the
step's worker thread, through prometheus_client's locked Counter and Histogram.

The gauges (requests running and queued, KV usage, cache hit rate, generation throughput) are
read from the scheduler when a snapshot is made, which the scheduler actor does between steps
only (the engine's state is the step thread's while a step runs): at most every
``PUBLISH_INTERVAL_S`` while it works, and once when it goes idle, so that the ingress sees
the gauges fall to 0 (``gen_throughput`` included) instead of keeping the last busy values.
"""

from __future__ import annotations

import time
from typing import Any

import trio
from prometheus_client import Counter, Gauge, Histogram

from app.engine.forward_batch import ForwardMode
from app.engine.request import Request
from app.engine.scheduling.batch import ScheduledBatch
from app.engine.scheduling.events import SchedulerEvents, add_observer
from app.observability import metrics
from app.observability.actor_metrics import ActorMetrics, Send


class SchedulerMetrics(ActorMetrics, SchedulerEvents):
    """The scheduler actor's registry; an observer of ``scheduler``'s events (see the module doc)."""

    def __init__(self, scheduler: Any, **options: Any) -> None:
        super().__init__("scheduler", **options)
        self.scheduler = scheduler
        by_priority = scheduler.limits.priority_scheduling
        self.priority_label = metrics.PriorityLabels() if by_priority else None
        r, name = self.registry, metrics.name
        self.num_running_reqs = Gauge(name("num_running_reqs"), "Requests admitted: decoding or prefilling.",
                                      registry=r)
        self.num_queue_reqs = Gauge(name("num_queue_reqs"), "Requests waiting for their first (or next) prefill.",
                                    registry=r)
        self.num_used_tokens = Gauge(name("num_used_tokens"), "KV slots held by live requests, in tokens.",
                                     registry=r)
        self.max_total_num_tokens = Gauge(name("max_total_num_tokens"), "KV slots in the pool, in tokens.",
                                          registry=r)
        self.token_usage = Gauge(name("token_usage"), "Share of the KV pool held by live requests (0 to 1); "
                                 "the prefix cache's evictable slots are free.", registry=r)
        self.full_token_usage = Gauge(name("full_token_usage"), "Share of the full-attention KV pool held by "
                                      "live requests; every layer is full attention: equal to token_usage.",
                                      registry=r)
        self.pending_prealloc_token_usage = Gauge(
            name("pending_prealloc_token_usage"), "Share of the KV pool the admission reserve keeps free for the "
            "running requests' future tokens (0 to 1).", registry=r)
        self.swa_token_usage = Gauge(name("swa_token_usage"), "Share of the sliding-window KV pool in use; always 0: "
                                     "no served model has sliding-window layers yet.", registry=r)
        self.mamba_usage = Gauge(name("mamba_usage"), "Share of the Mamba state pool in use; always 0: no served "
                                 "model has Mamba layers yet.", registry=r)
        self.cache_hit_rate = Gauge(name("cache_hit_rate"), "Share of the prompt tokens admitted since the previous "
                                    "snapshot that the prefix cache held (0 to 1); unchanged while none is admitted.",
                                    registry=r)
        self.gen_throughput = Gauge(name("gen_throughput"), "Tokens sampled per second since the previous "
                                    "snapshot; 0 while the scheduler is idle.", registry=r)
        priority = ("priority",) if by_priority else ()
        self.queue_time = Histogram(name("queue_time_seconds"), "Time from a request's arrival at the HTTP layer "
                                    "to its first prefill.", priority, buckets=metrics.QUEUE_TIME_BUCKETS, registry=r)
        self.prefill_time = Histogram(name("prefill_time_seconds"), "Duration of one prefill step, from its launch to "
                                      "its tokens applied.", buckets=metrics.PREFILL_STEP_BUCKETS, registry=r)
        self.decode_time = Histogram(name("decode_time_seconds"), "Duration of one decode step, from its launch to "
                                     "its tokens applied.", buckets=metrics.DECODE_STEP_BUCKETS, registry=r)
        self.preempted = Counter(name("num_preempted_requests"), "Running requests sent back to the queue for a "
                                 "more important waiting one (priority scheduling).", registry=r)
        self.retracted_for_kv = Counter(name("num_retracted_requests"), "Running requests sent back to the queue "
                                        "because the KV pool ran short.", registry=r)
        self.step_errors = Counter(name("num_step_errors"), "Steps that failed with an error the scheduler "
                                   "recovers from (kind: oom), ending their requests; the server goes on.",
                                   ("kind",), registry=r)
        self.step_errors.labels("oom")  # shown at 0 from the start
        self.max_total_num_tokens.set(scheduler.memory.capacity)
        # Since the previous snapshot: tokens sampled, prompt tokens admitted and how many were cached.
        self._sampled = 0
        self._admitted_prompt = 0
        self._admitted_cached = 0
        self._window_start = time.monotonic()
        self._idle = False  # the snapshot being made is the one of going idle

    # ------------------------------------------------------------ events (the step's thread)

    def admitted(self, req: Request, now: float) -> None:
        if req.times_retracted:  # back after a retraction: its queue time was counted the first time
            return
        self._admitted_prompt += len(req.prompt_ids)
        self._admitted_cached += req.cached_tokens
        if req.arrival_time:
            wait = max(0.0, now - req.arrival_time)
            if self.priority_label is None:
                self.queue_time.observe(wait)
            else:
                self.queue_time.labels(self.priority_label(req.priority)).observe(wait)

    def batch_processed(self, batch: ScheduledBatch, launched_at: float, now: float) -> None:
        if batch.mode is ForwardMode.DECODE:
            self.decode_time.observe(now - launched_at)
            self._sampled += len(batch.reqs)
        else:
            self.prefill_time.observe(now - launched_at)
            self._sampled += sum(batch.samples)

    def retracted(self, req: Request, now: float, *, preempted: bool) -> None:
        (self.preempted if preempted else self.retracted_for_kv).inc()

    def step_failed(self, kind: str) -> None:
        """A step failed and was recovered from (app/actors/step_recovery.py)."""
        self.step_errors.labels(kind).inc()

    # ------------------------------------------------------------ snapshots (between steps)

    def refresh(self) -> None:
        """Read the gauges from the scheduler; only between steps."""
        scheduler = self.scheduler
        usage = scheduler.memory.usage(scheduler.requests.values())
        total = usage.total or 1
        waiting = len(scheduler.waiting)
        self.num_running_reqs.set(len(scheduler.requests) - waiting)
        self.num_queue_reqs.set(waiting)
        self.num_used_tokens.set(usage.used)
        self.token_usage.set(usage.used / total)
        self.full_token_usage.set(usage.used / total)
        ratio = scheduler.reserve.ratio()
        reserved = sum(int(r.remaining_new_tokens() * ratio) for r in scheduler.running.staying())
        self.pending_prealloc_token_usage.set(min(1.0, reserved / total))
        if self._admitted_prompt:
            self.cache_hit_rate.set(self._admitted_cached / self._admitted_prompt)
        now = time.monotonic()
        elapsed = now - self._window_start
        self.gen_throughput.set(0.0 if self._idle or elapsed <= 0 else self._sampled / elapsed)
        self._sampled = self._admitted_prompt = self._admitted_cached = 0
        self._window_start = now

    async def publish_if_due(self, send: Send) -> None:
        """A snapshot, if ``interval_s`` has passed since the last one; after each step."""
        if trio.current_time() >= self.last_published_at + self.interval_s:
            await self.publish(send)

    async def went_idle(self, send: Send) -> None:
        """A snapshot now: the scheduler has nothing to do (no request, no output to send)."""
        self._idle = True
        try:
            await self.publish(send)
        finally:
            self._idle = False


def scheduler_metrics(scheduler: Any) -> SchedulerMetrics:
    """Metrics observing ``scheduler`` (added to its event observers)."""
    observer = SchedulerMetrics(scheduler)
    add_observer(scheduler, observer)
    return observer
