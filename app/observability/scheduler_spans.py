"""The scheduler's spans of each traced request (--enable-trace): a SchedulerEvents observer.

For a request that carries a ``traceparent`` (``Request.traceparent``), children of its trace's
root span, each recorded when it ends with the times the scheduler reported:

- ``queue``: from the request's arrival (its ``arrival_time``, stamped by the HTTP layer, from
  which ``--waiting-timeout`` also counts: tokenization and the channels are inside it) to its
  admission; after a retraction or preemption, another one from then to its next admission.
  A request that ends without being admitted (aborted, timed out, evicted by a more important
  one, nothing to generate) ends its queue span there.
- ``prefill``: one per prefill chunk of the request, from the step's launch until its results
  were applied, with the chunk's tokens and the batch's size.
- ``decode``: from the first output token to the finish, with the completion tokens and the
  finish reason.

Attributes: ``app.request_id``, ``app.prompt_tokens``, ``app.cached_tokens`` (after admission),
``app.chunk_tokens``, ``app.completion_tokens``, ``app.finish_reason``, ``app.status_code`` (an
abort's HTTP status). An aborted request's last span has the error status. Untraced requests
cost one attribute check per event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.engine.forward_batch import ForwardMode
from app.engine.request import Request
from app.engine.scheduling.batch import ScheduledBatch
from app.engine.scheduling.events import SchedulerEvents
from app.observability.tracing import ProcessTracing, finish_attributes


@dataclass
class _TracedRequest:
    """What the scheduler's spans of one request need between events."""

    waiting_since: float | None  # the start of the open queue span; None while admitted
    requeued: str | None = None  # why the open queue span started: "retracted" or "preempted"
    first_token_at: float | None = None


class SchedulerSpans(SchedulerEvents):
    """Records the queue, prefill and decode spans of traced requests (module docstring)."""

    def __init__(self, tracing: ProcessTracing) -> None:
        self.tracing = tracing
        self.requests: dict[str, _TracedRequest] = {}

    def _state(self, req: Request, now: float) -> _TracedRequest:
        state = self.requests.get(req.rid)
        if state is None:
            state = self.requests[req.rid] = _TracedRequest(waiting_since=req.arrival_time or now)
        return state

    def admitted(self, req: Request, now: float) -> None:
        if req.traceparent is None:
            return
        state = self._state(req, now)
        if state.waiting_since is None:
            return
        attributes = self._attributes(req)
        if state.requeued is not None:
            attributes["app.requeued"] = state.requeued
        self.tracing.span("queue", req.traceparent, state.waiting_since, now, attributes)
        state.waiting_since, state.requeued = None, None

    def batch_processed(self, batch: ScheduledBatch, launched_at: float, now: float) -> None:
        if batch.mode is not ForwardMode.EXTEND:
            return
        batch_size, batch_tokens = len(batch.reqs), sum(batch.extend_lens)
        for req, tokens, completes in zip(batch.reqs, batch.extend_lens, batch.samples):
            if req.traceparent is None:
                continue
            self.tracing.span("prefill", req.traceparent, launched_at, now, {
                "app.request_id": req.rid,
                "app.chunk_tokens": tokens,
                "app.prompt_complete": completes,  # the last chunk: it samples the first token
                "app.batch_requests": batch_size,
                "app.batch_tokens": batch_tokens,
            })

    def first_token(self, req: Request, now: float) -> None:
        if req.traceparent is not None:
            self._state(req, now).first_token_at = now

    def retracted(self, req: Request, now: float, *, preempted: bool) -> None:
        if req.traceparent is not None:
            state = self._state(req, now)
            state.waiting_since, state.requeued = now, "preempted" if preempted else "retracted"

    def finished(self, req: Request, now: float) -> None:
        if req.traceparent is None:
            return
        state = self.requests.pop(req.rid, None) or _TracedRequest(waiting_since=req.arrival_time or now)
        finish = req.finish
        attributes = self._attributes(req)
        error = finish_attributes(finish, attributes)
        attributes["app.completion_tokens"] = len(req.output_ids)
        if state.first_token_at is not None:  # (a retracted one that ends waiting: its queue span too)
            self.tracing.span("decode", req.traceparent, state.first_token_at, now, attributes, error)
        if state.waiting_since is not None:  # it ended waiting: its queue span ends here
            if state.requeued is not None:
                attributes["app.requeued"] = state.requeued
            self.tracing.span("queue", req.traceparent, state.waiting_since, now, attributes, error)

    @staticmethod
    def _attributes(req: Request) -> dict[str, Any]:
        return {"app.request_id": req.rid, "app.prompt_tokens": len(req.prompt_ids),
                "app.cached_tokens": req.cached_tokens}
