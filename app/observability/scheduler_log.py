"""The scheduler's log lines, as observers of its events (app.engine.scheduling.events).

Always, at info, as SGLang logs them:

- ``Prefill batch``: one per prefill batch when it is launched: requests in it (``new_seq``),
  prompt tokens it computes (``new_token``), prompt tokens the prefix cache served to the
  requests admitted into it (``cached_token``) and that share of their prompts
  (``cache_hit_rate``), then the KV pool's use and the running and waiting requests.
- ``Decode batch``: one every --decode-log-interval decode steps, when the step that completes
  the interval has been processed: the pool's use, the running and waiting requests, and the
  generation throughput over the interval (tokens decoded / seconds from the interval's first
  decode step's launch to now).

With --log-requests, each request's moments too (:class:`SchedulerRequestLog`; the request
logs of the other actors are in app.observability.request_log).

The figures come from counters the scheduler keeps anyway (free slots, the cache's evictable
size, the queue's length), never from ``Scheduler.stats()``, which reads the device to check
the allocator. Observers run inside the step, in the scheduler actor's worker thread, and
never raise into it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Any, TypeVar

from app.engine.forward_batch import ForwardMode
from app.engine.request import Request
from app.engine.scheduling.batch import ScheduledBatch
from app.engine.scheduling.events import SchedulerEvents
from app.observability.logs import get_logger
from app.observability.request_log import EVERYTHING, Detail, ms, request_log_level
from app.observability.settings import ObservabilitySettings

F = TypeVar("F", bound=Callable[..., None])


def _never_raises(method: F) -> F:
    """An observer's method that logs its own failure instead of failing the step."""

    @wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            method(self, *args, **kwargs)
        except Exception:  # noqa: BLE001 - an observer never fails the step
            self.log.exception("scheduler log failed", observer=type(self).__name__, method=method.__name__)

    return guarded  # type: ignore[return-value]


def _since(start: float, end: float | None) -> float | None:
    """Milliseconds from ``start`` (a request's arrival, wall clock; 0 when unknown) to ``end``."""
    return ms(end - start) if start and end is not None else None


class SchedulerStatsLog(SchedulerEvents):
    """``Prefill batch`` and ``Decode batch`` lines (see the module doc)."""

    def __init__(self, scheduler: Any, decode_log_interval: int) -> None:
        if decode_log_interval < 1:
            raise ValueError(f"--decode-log-interval must be at least 1, got {decode_log_interval}")
        self.scheduler = scheduler
        self.interval = decode_log_interval
        self.log = get_logger()
        self.admitted_cached = 0  # prompt tokens from the cache, of requests admitted since the last prefill launch
        self.admitted_prompt = 0  # their prompt tokens
        self.decode_steps = 0  # decode steps processed since start
        self.interval_tokens = 0  # tokens decoded in this interval
        self.interval_started: float | None = None  # launch time of this interval's first decode step

    def _pool(self) -> dict[str, Any]:
        """The KV pool's use and the requests, from counters (no device read)."""
        scheduler = self.scheduler
        memory = scheduler.memory
        capacity = memory.capacity
        used = capacity - memory.available()  # held by requests: neither free nor evictable cache
        return {
            "token_usage": round(used / capacity, 4) if capacity else 0.0,
            "kv_tokens": used,
            "running_req": scheduler.running.active(),
            "queue_req": len(scheduler.waiting),
        }

    @_never_raises
    def admitted(self, req: Request, now: float) -> None:
        self.admitted_cached += req.cached_tokens
        self.admitted_prompt += len(req.prompt_ids)

    @_never_raises
    def batch_launched(self, batch: ScheduledBatch, now: float) -> None:
        if batch.mode is not ForwardMode.EXTEND:
            return
        cached, prompt = self.admitted_cached, self.admitted_prompt
        self.admitted_cached = self.admitted_prompt = 0
        self.log.info("Prefill batch", new_seq=len(batch.reqs), new_token=sum(batch.extend_lens), cached_token=cached,
                      cache_hit_rate=round(cached / prompt, 4) if prompt else 0.0, **self._pool())

    @_never_raises
    def batch_processed(self, batch: ScheduledBatch, launched_at: float, now: float) -> None:
        if batch.mode is not ForwardMode.DECODE:
            return
        if self.interval_started is None:
            self.interval_started = launched_at
        self.decode_steps += 1
        self.interval_tokens += len(batch.reqs)
        if self.decode_steps % self.interval:
            return
        seconds = max(now - self.interval_started, 1e-9)
        self.log.info("Decode batch", decode_steps=self.decode_steps, **self._pool(),
                      gen_throughput=round(self.interval_tokens / seconds, 2))
        self.interval_tokens, self.interval_started = 0, None


@dataclass
class _Moments:
    admitted: float | None = None
    first_token: float | None = None


class SchedulerRequestLog(SchedulerEvents):
    """The scheduler's request-log lines (--log-requests): admitted, first token, retracted, finished."""

    def __init__(self, level: int) -> None:
        self.detail = Detail(level)
        self.moments: dict[str, _Moments] = {}  # until the request finishes
        self.log = get_logger()

    @_never_raises
    def admitted(self, req: Request, now: float) -> None:
        moments = self.moments.setdefault(req.rid, _Moments())
        if moments.admitted is None:
            moments.admitted = now
        self.log.info("request admitted", rid=req.rid, queue_ms=_since(req.arrival_time, now),
                      prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens,
                      times_retracted=req.times_retracted)

    @_never_raises
    def first_token(self, req: Request, now: float) -> None:
        self.moments.setdefault(req.rid, _Moments()).first_token = now
        self.log.info("request first token", rid=req.rid, ttft_ms=_since(req.arrival_time, now))

    @_never_raises
    def retracted(self, req: Request, now: float, *, preempted: bool) -> None:
        self.log.info("request retracted", rid=req.rid, preempted=preempted, output_tokens=len(req.output_ids),
                      times_retracted=req.times_retracted)

    @_never_raises
    def finished(self, req: Request, now: float) -> None:
        moments = self.moments.pop(req.rid, None) or _Moments()
        finish = req.finish
        fields: dict[str, Any] = {
            "finish_reason": finish.reason.value if finish is not None else None,
            "status": finish.status_code if finish is not None and finish.status_code else 200,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "times_retracted": req.times_retracted,
            "queue_ms": _since(req.arrival_time, moments.admitted),
            "ttft_ms": _since(req.arrival_time, moments.first_token),
            "e2e_ms": _since(req.arrival_time, now),
        }
        if finish is not None and finish.message:
            fields["message"] = finish.message
        if self.detail.level >= EVERYTHING:
            fields["output_ids"] = list(req.output_ids)
        self.log.info("request finished", rid=req.rid, **fields)


def scheduler_log_observers(scheduler: Any, settings: ObservabilitySettings) -> list[SchedulerEvents]:
    """The observers that write the scheduler's lines under ``settings``."""
    observers: list[SchedulerEvents] = [SchedulerStatsLog(scheduler, settings.decode_log_interval)]
    level = request_log_level(settings)
    if level is not None:
        observers.append(SchedulerRequestLog(level))
    return observers

