"""A child actor's metrics and how they reach the ingress (--enable-metrics).

Each actor records into its own registry (:class:`ActorMetrics`) and sends the whole of it, as a
``MetricsSnapshot``, at most every ``PUBLISH_INTERVAL_S`` while something changed, and not at
all while nothing did. The tokenizer and the detokenizer read their inbox through
:class:`PublishingInbox`, which sends a snapshot whenever one is due, including while the inbox
is empty: no extra task, and the last changes before an idle spell go out within the interval.
The scheduler publishes from its own loop (scheduler_metrics.py), between steps.

Without --enable-metrics none of this exists: the actors read their inboxes directly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import trio
from prometheus_client import Counter, Histogram

from app.ipc.messages import MetricsSnapshot
from app.observability import metrics
from app.observability.settings import ObservabilitySettings

PUBLISH_INTERVAL_S = 0.5

T = TypeVar("T")
A = TypeVar("A")
R = TypeVar("R")
Send = Callable[[MetricsSnapshot], Awaitable[None]]


class ActorMetrics:
    """One actor's registry, and the snapshots it sends: a new one only when it differs from
    the last sent (gauges are read by :meth:`refresh` just before)."""

    def __init__(self, actor: str, *, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        if not interval_s > 0:
            raise ValueError(f"the metrics interval must be > 0 s, got {interval_s}")
        self.actor = actor
        self.registry = metrics.registry()
        self.interval_s = interval_s
        self.changed = False  # something was recorded since the last snapshot was made
        self.last_sent: MetricsSnapshot | None = None
        self.last_published_at = -math.inf  # trio.current_time() of the last snapshot made

    def refresh(self) -> None:
        """Set the gauges that are read rather than recorded; nothing here."""

    def snapshot(self) -> MetricsSnapshot:
        self.refresh()
        return MetricsSnapshot(self.actor, metrics.families_of(self.registry))

    def due_at(self) -> float:
        """When the next snapshot is due (trio's clock); infinity while nothing changed."""
        return self.last_published_at + self.interval_s if self.changed else math.inf

    async def publish(self, send: Send) -> bool:
        """Send a snapshot unless it equals the last one sent; True when one went out."""
        snapshot = self.snapshot()
        self.changed = False
        self.last_published_at = trio.current_time()
        if snapshot == self.last_sent:
            return False
        await send(snapshot)
        self.last_sent = snapshot
        return True


class PublishingInbox(Generic[T]):
    """``inbox``, iterated; while it is read, ``actor_metrics`` are sent on ``send`` whenever
    they are due, whether messages are coming or not. Receiving is cancel-safe (app/ipc/channel.py),
    so a receive cut short by the publishing deadline loses nothing."""

    def __init__(self, inbox: Any, actor_metrics: ActorMetrics, send: Send) -> None:
        self.inbox = inbox
        self.metrics = actor_metrics
        self.send = send

    def __aiter__(self) -> PublishingInbox[T]:
        return self

    async def __anext__(self) -> T:
        while True:
            with trio.move_on_at(self.metrics.due_at()):
                try:
                    return await self.inbox.receive()
                except trio.EndOfChannel:
                    raise StopAsyncIteration from None
            await self.metrics.publish(self.send)


class TokenizerMetrics(ActorMetrics):
    """What the tokenizer measures: the time it takes to turn one request into token ids."""

    def __init__(self, **options: Any) -> None:
        super().__init__("tokenizer", **options)
        self.tokenize_time = Histogram(
            metrics.name("tokenize_time_seconds"),
            "Time the tokenizer took to check and tokenize one request (chat template included).",
            buckets=metrics.TEXT_WORK_BUCKETS, registry=self.registry)

    def timed(self, tokenize: Callable[[A], R]) -> Callable[[A], R]:
        """``tokenize``, its every call timed."""

        def tokenize_timed(request: A) -> R:
            started = time.perf_counter()
            result = tokenize(request)
            self.tokenize_time.observe(time.perf_counter() - started)
            self.changed = True
            return result

        return tokenize_timed


class DetokenizerMetrics(ActorMetrics):
    """What the detokenizer measures: the time it takes to turn one step's tokens into text, and
    the stop strings it matched."""

    def __init__(self, **options: Any) -> None:
        super().__init__("detokenizer", **options)
        self.detokenize_time = Histogram(
            metrics.name("detokenize_time_seconds"),
            "Time the detokenizer took to turn one scheduler step's outputs into text.",
            buckets=metrics.TEXT_WORK_BUCKETS, registry=self.registry)
        self.stop_string_hits = Counter(
            metrics.name("stop_string_hits"),
            "Requests ended by a stop string the detokenizer matched in their text.",
            registry=self.registry)

    def timed(self, process: Callable[[A], tuple[list[Any], list[Any]]]) -> Callable[[A], tuple[list[Any], list[Any]]]:
        """``process`` (Detokenization.process: outputs in, texts and stop-string hits out), its
        every call timed and its hits counted."""

        def process_timed(outputs: A) -> tuple[list[Any], list[Any]]:
            started = time.perf_counter()
            texts, hits = process(outputs)
            self.detokenize_time.observe(time.perf_counter() - started)
            if hits:
                self.stop_string_hits.inc(len(hits))
            self.changed = True
            return texts, hits

        return process_timed


def enabled(config: dict[str, Any]) -> bool:
    """Whether this actor's configuration asks for metrics (--enable-metrics)."""
    return ObservabilitySettings.from_config(config.get("observability")).enable_metrics

