"""The ingress's metrics registry (--enable-metrics): its own measurements and every actor's.

One ``CollectorRegistry`` serves ``GET /metrics``. :class:`ServerMetrics`, registered in it as a
prometheus_client collector, yields

- the ingress's own metrics, recorded where requests and their outputs pass through the ingress
  (:class:`MeteredBackend`) and the HTTP layer (http_metrics.py);
- the latest snapshot of each actor (tokenizer, scheduler, detokenizer) that the ingress
  received (``LatestSnapshots``), with the ``model_name`` label added.

Every request the ingress is given (each of its choices) is counted once when it ends, in one
of two counters: ``num_requests_total{finish_reason}`` when it ran to an answer (stop, length,
or abort: the client left or an operator aborted it), ``num_rejected_requests_total{reason}``
when its client got an error instead (refused at once, rejected by the tokenizer or the
scheduler, timed out, or the server failed). docs/metrics.md has the whole list.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

from app.http.backend import Answer, Backend, Failure, ModelCard, RequestError, ServerError, ServerState
from app.ipc.messages import QUEUE_FULL_MESSAGE, ControlKind, FinishReason, GenerateRequest, MetricsSnapshot, TextOutput
from app.observability import metrics

FINISH_REASONS = tuple(reason.value for reason in FinishReason)
# Why a request's client got an error instead of an answer (num_rejected_requests_total's reason).
REJECTION_REASONS = ("queue_full", "timeout", "invalid", "too_large", "unavailable", "error")
# Abort statuses that are answers, not errors (app/http/outputs.py): the client or an operator asked.
_ANSWERED_ABORT_STATUSES = (None, 499)


def rejection_reason(status: int, message: str) -> str:
    """The ``reason`` label of a request refused with ``status`` and ``message``."""
    if status == 503 and message == QUEUE_FULL_MESSAGE:
        return "queue_full"
    if "timeout" in message:  # the scheduler's waiting and request timeouts (deadlines.py) name theirs
        return "timeout"
    if status == 413:
        return "too_large"
    if 400 <= status < 500:
        return "invalid"
    if status == 503:
        return "unavailable"  # stopping, or evicted from a full queue by a more important request
    return "error"


class LatestSnapshots:
    """The latest MetricsSnapshot of each actor, as the ingress received them."""

    def __init__(self) -> None:
        self.by_actor: dict[str, MetricsSnapshot] = {}

    def keep(self, snapshot: MetricsSnapshot) -> None:
        self.by_actor[snapshot.actor] = snapshot


class ServerMetrics:
    """The ingress's metrics and the collector that shows them with the actors' (module doc)."""

    def __init__(self, model_name: str, snapshots: LatestSnapshots, *, priority_scheduling: bool = False) -> None:
        self.model_name = model_name
        self.snapshots = snapshots
        self.priority_label = metrics.PriorityLabels() if priority_scheduling else None
        self._children: dict[tuple[Any, ...], Any] = {}  # _per_request's: every labelled child used so far
        own = self.own = metrics.registry()  # the ingress's own, yielded through collect()
        name = metrics.name
        model = ("model_name",)
        per_request = (*model, "priority") if priority_scheduling else model
        self.ttft = Histogram(name("time_to_first_token_seconds"), "Time from a request's arrival at the HTTP layer "
                              "to its first output token reaching the ingress.", per_request,
                              buckets=metrics.TTFT_BUCKETS, registry=own)
        self.itl = Histogram(name("inter_token_latency_seconds"), "Time between output tokens of a request at the "
                             "ingress; an output of k tokens counts k gaps of 1/k of its wait.", per_request,
                             buckets=metrics.ITL_BUCKETS, registry=own)
        self.e2e = Histogram(name("e2e_request_latency_seconds"), "Time from a request's arrival at the HTTP layer to "
                             "its final answer reaching the ingress.", per_request,
                             buckets=metrics.E2E_BUCKETS, registry=own)
        self.prompt_tokens = Counter(name("prompt_tokens"), "Prompt tokens of the requests that reached the "
                                     "scheduler.", model, registry=own).labels(model_name)
        self.generation_tokens = Counter(name("generation_tokens"), "Output tokens delivered to the HTTP layer "
                                         "(tokens past a stop string are never delivered).", model,
                                         registry=own).labels(model_name)
        self.cached_tokens = Counter(name("cached_tokens"), "Prompt tokens served from the prefix cache.", model,
                                     registry=own).labels(model_name)
        self.requests = Counter(name("num_requests"), "Requests that ran to an answer, by finish reason (abort: the "
                                "client left or an operator aborted it).", (*per_request, "finish_reason"),
                                registry=own)
        self.aborted = Counter(name("num_aborted_requests"), "Requests aborted after the scheduler took them: the "
                               "client left, /abort_request, a timeout, an eviction or shutdown.", model,
                               registry=own).labels(model_name)
        self.rejected = Counter(name("num_rejected_requests"), "Requests whose client got an error instead of an "
                                "answer, by reason.", (*model, "reason"), registry=own)
        self.http_requests = Counter(name("http_requests"), "HTTP requests answered, by route and status (route "
                                     "'other': an unknown path; 'connection': refused past --max-connections).",
                                     (*model, "route", "status"), registry=own)
        for reason in REJECTION_REASONS:  # every series exists from the start
            self.rejected.labels(model_name, reason)
        if self.priority_label is None:
            for finish_reason in FINISH_REASONS:
                self.requests.labels(model_name, finish_reason)
        self.registry = CollectorRegistry(auto_describe=False)  # what GET /metrics shows
        self.registry.register(self)

    # ------------------------------------------------------------ the collector

    def collect(self) -> Iterator[Metric]:
        """The ingress's metrics, then each actor's latest (families of one name merged)."""
        labels = (("model_name", self.model_name),)
        actors = [metrics.labelled(family, labels)
                  for snapshot in list(self.snapshots.by_actor.values()) for family in snapshot.families]
        for family in metrics.merged([*metrics.families_of(self.own), *actors]):
            yield metrics.to_metric(family)

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The text for ``GET /metrics`` in the format ``accept`` prefers, and its content type."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    # ------------------------------------------------------------ what the ingress records

    def _per_request(self, metric: Any, priority: int, *extra: str) -> Any:
        """``metric``'s child for a request of ``priority`` (and the ``extra`` label values),
        looked up once: ``labels()`` takes a lock and builds a key every call."""
        label = None if self.priority_label is None else self.priority_label(priority)  # bounded: PriorityLabels
        key = (id(metric), label, *extra)
        child = self._children.get(key)
        if child is None:
            values = (self.model_name,) if label is None else (self.model_name, label)
            child = self._children[key] = metric.labels(*values, *extra)
        return child

    def output(self, request: _Tracked, output: TextOutput, now: float) -> None:
        """One output of ``request`` reached the ingress."""
        if output.usage is not None and not request.prompt_counted:  # the first output carries it
            request.prompt_counted = True
            self.prompt_tokens.inc(output.usage.prompt_tokens)
            self.cached_tokens.inc(output.usage.cached_tokens)
        tokens = len(output.token_ids) >> 2  # packed int32
        if tokens:
            self.generation_tokens.inc(tokens)
            if request.first_at is None:
                request.first_at = now
                self._per_request(self.ttft, request.priority).observe(now - request.arrival)
            else:
                itl, gap = self._per_request(self.itl, request.priority), (now - request.last_at) / tokens
                for _ in range(tokens):
                    itl.observe(gap)
            request.last_at = now
        finish = output.finish
        if finish is None:
            return
        request.ended = True
        queued = request.prompt_counted  # the scheduler took it (its refusals carry no usage)
        if finish.reason is FinishReason.ABORT and queued:
            self.aborted.inc()
        if finish.reason is FinishReason.ABORT and finish.status_code not in _ANSWERED_ABORT_STATUSES:
            self.reject(finish.status_code or 500, finish.message or "")
            return
        self._per_request(self.requests, request.priority, finish.reason.value).inc()
        self._per_request(self.e2e, request.priority).observe(now - request.arrival)

    def left(self, request: _Tracked) -> None:
        """``request``'s reader let go of it before its final answer: the client left."""
        request.ended = True
        self._per_request(self.requests, request.priority, FinishReason.ABORT.value).inc()
        self.aborted.inc()

    def reject(self, status: int, message: str) -> None:
        self.rejected.labels(self.model_name, rejection_reason(status, message)).inc()

    def http_answered(self, route: str, status: int) -> None:
        self.http_requests.labels(self.model_name, route, str(status)).inc()

    def connection_refused(self) -> None:
        """A connection past --max-connections was answered 503 (app/http/server.py)."""
        self.http_answered("connection", 503)


class _Tracked:
    """One request's answers channel, as the backend delivers into it (``send_nowait``, ``close``,
    ``with``: a trio MemorySendChannel's): each answer is recorded, at the time it reaches the
    ingress, then passed on."""

    __slots__ = ("answers", "recorder", "arrival", "priority", "first_at", "last_at", "prompt_counted", "ended")

    def __init__(self, request: GenerateRequest, answers: trio.MemorySendChannel[Answer],
                 recorder: ServerMetrics) -> None:
        self.answers = answers
        self.recorder = recorder
        self.arrival = request.arrival_time or time.time()
        self.priority = request.priority
        self.first_at: float | None = None
        self.last_at = 0.0
        self.prompt_counted = False
        self.ended = False  # its last answer came, or it was counted as left

    def send_nowait(self, answer: Answer) -> None:
        if isinstance(answer, Failure):
            self.ended = True
            self.recorder.reject(answer.error.status_code, answer.error.message)
        else:
            self.recorder.output(self, answer, time.time())
        self.answers.send_nowait(answer)

    def close(self) -> None:
        self.answers.close()

    def __enter__(self) -> _Tracked:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class MeteredBackend:
    """``backend`` (the ingress), with every request it is given recorded in ``recorder``."""

    def __init__(self, backend: Backend, recorder: ServerMetrics) -> None:
        self.backend = backend
        self.recorder = recorder
        self.live: dict[str, _Tracked] = {}

    @property
    def model(self) -> ModelCard:
        return self.backend.model

    @property
    def state(self) -> ServerState:
        return self.backend.state

    async def submit(self, request: GenerateRequest, answers: trio.MemorySendChannel[Answer]) -> None:
        tracked = _Tracked(request, answers, self.recorder)
        try:
            await self.backend.submit(request, tracked)  # type: ignore[arg-type]  # it sends and closes, as a channel
        except (RequestError, ServerError) as exc:  # refused at once: nothing was registered
            self.recorder.reject(exc.status_code, exc.message)
            raise
        except BaseException:  # cancelled while sending: the backend released (aborted) it
            self.recorder.left(tracked)
            raise
        self.live[request.rid] = tracked

    async def release(self, rid: str) -> None:
        tracked = self.live.pop(rid, None)
        if tracked is not None and not tracked.ended:
            self.recorder.left(tracked)
        await self.backend.release(rid)

    async def abort(self, rid: str | None) -> bool:
        return await self.backend.abort(rid)

    async def control(self, kind: ControlKind) -> bytes:
        return await self.backend.control(kind)

    async def server_info(self) -> dict:
        return await self.backend.server_info()
