"""The plumbing of the metrics between processes: an actor's registry as a MetricsSnapshot, through
the real wire encoding, into the ingress's collector, out as the text prometheus_client's parser
reads; and when an actor sends its snapshots (PublishingInbox, on trio's mock clock)."""

from __future__ import annotations

import msgspec
import pytest
import trio
import trio.testing
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from app.ipc.messages import MetricsSnapshot, ToIngress
from app.observability import metrics
from app.observability.actor_metrics import ActorMetrics, PublishingInbox, TokenizerMetrics
from app.observability.ingress_metrics import LatestSnapshots, ServerMetrics, rejection_reason


def over_the_wire(snapshot: MetricsSnapshot) -> MetricsSnapshot:
    """``snapshot`` encoded and decoded as the ingress's channels do (one ToIngress union)."""
    return msgspec.msgpack.Decoder(ToIngress).decode(msgspec.msgpack.encode(snapshot))


def exposed(server: ServerMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    body, content_type = server.exposition(None)
    assert content_type.startswith("text/plain; version=0.0.4")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_an_actor_registry_reaches_the_ingress_exposition_whole():
    actor = ActorMetrics("scheduler")
    counter = Counter("app:steps", "Steps.", ["kind"], registry=actor.registry)
    gauge = Gauge("app:queue", "Queued.", registry=actor.registry)
    histogram = Histogram("app:wait_seconds", "Waits.", buckets=(0.1, 1.0), registry=actor.registry)
    counter.labels("decode").inc(7)
    gauge.set(3)
    histogram.observe(0.5)
    histogram.observe(2.0)
    snapshot = over_the_wire(actor.snapshot())
    assert isinstance(snapshot, MetricsSnapshot) and snapshot.actor == "scheduler"
    assert not any(s.name.endswith("_created") for f in snapshot.families for s in f.samples)
    snapshots = LatestSnapshots()
    snapshots.keep(snapshot)
    samples = exposed(ServerMetrics("tiny", snapshots))
    model = ("model_name", "tiny")
    assert samples[("app:steps_total", frozenset({model, ("kind", "decode")}))] == 7
    assert samples[("app:queue", frozenset({model}))] == 3
    assert samples[("app:wait_seconds_bucket", frozenset({model, ("le", "0.1")}))] == 0
    assert samples[("app:wait_seconds_bucket", frozenset({model, ("le", "1.0")}))] == 1
    assert samples[("app:wait_seconds_bucket", frozenset({model, ("le", "+Inf")}))] == 2
    assert samples[("app:wait_seconds_count", frozenset({model}))] == 2
    assert samples[("app:wait_seconds_sum", frozenset({model}))] == 2.5
    # the ingress's own metrics are there too, from the start
    assert samples[("app:num_requests_total", frozenset({model, ("finish_reason", "stop")}))] == 0
    assert not any(name.endswith("_created") for name, _ in samples)


def test_the_latest_snapshot_of_each_actor_is_shown_and_same_names_are_added_up():
    snapshots = LatestSnapshots()
    server = ServerMetrics("tiny", snapshots)
    for actor, value in (("tokenizer", 2), ("detokenizer", 5)):
        source = ActorMetrics(actor)
        Counter("app:shared_things", "Things.", registry=source.registry).inc(value)
        snapshots.keep(source.snapshot())
    newer = ActorMetrics("tokenizer")
    Counter("app:shared_things", "Things.", registry=newer.registry).inc(10)
    snapshots.keep(newer.snapshot())  # replaces the tokenizer's earlier one
    assert exposed(server)[("app:shared_things_total", frozenset({("model_name", "tiny")}))] == 10 + 5


def test_priority_labels_stop_growing_at_their_limit():
    label = metrics.PriorityLabels(limit=2)
    assert [label(p) for p in (5, -1, 5, 7, 9, -1)] == ["5", "-1", "5", "other", "other", "-1"]
    with pytest.raises(ValueError, match="at least 1"):
        metrics.PriorityLabels(limit=0)


@pytest.mark.parametrize(("status", "message", "reason"), [
    (503, "The request queue is full.", "queue_full"),
    (503, "the request waited longer than the waiting timeout (1.0 s)", "timeout"),
    (503, "the request took longer than the request timeout (2.0 s)", "timeout"),
    (503, "The server is shutting down.", "unavailable"),
    (413, "The prompt is too large", "too_large"),
    (400, "The input (300 tokens) is longer than the model's context length (256 tokens).", "invalid"),
    (500, "Internal error while tokenizing the request.", "error"),
])
def test_rejection_reasons(status, message, reason):
    assert rejection_reason(status, message) == reason


async def test_a_snapshot_goes_out_only_when_it_changed():
    actor = ActorMetrics("detokenizer")
    counter = Counter("app:n", "N.", registry=actor.registry)
    sent: list[MetricsSnapshot] = []

    async def send(snapshot: MetricsSnapshot) -> None:
        sent.append(snapshot)

    assert await actor.publish(send)
    assert not await actor.publish(send)
    counter.inc()
    assert await actor.publish(send)
    assert [f.samples[0].value for s in sent for f in s.families] == [0, 1]


def test_the_inbox_publishes_when_due_while_busy_and_while_idle():
    async def main() -> tuple[list[str], list[tuple[float, float]]]:
        tokenizer = TokenizerMetrics(interval_s=0.5)
        tokenize = tokenizer.timed(str.upper)
        send_messages, receive_messages = trio.open_memory_channel[str](10)
        sent: list[tuple[float, float]] = []  # (when, tokenize_time count)

        async def send(snapshot: MetricsSnapshot) -> None:
            family = next(f for f in snapshot.families if f.name == "app:tokenize_time_seconds")
            sent.append((trio.current_time(), next(s.value for s in family.samples if s.name.endswith("_count"))))

        async def producer() -> None:
            async with send_messages:
                for text in ("a", "b", "c"):
                    await send_messages.send(text)
                    await trio.sleep(0.2)
                await trio.sleep(3.0)  # idle: the last changes still go out
                await send_messages.send("d")

        received = []
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer)
            async for message in PublishingInbox(receive_messages, tokenizer, send):
                received.append(tokenize(message))
        return received, [(round(when - start, 3), count) for when, count in sent]

    received, sent = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert received == ["A", "B", "C", "D"]  # nothing lost to a receive cut short
    # at once after the first change (nothing sent yet); "b" and "c" 0.5 s after it, while the inbox
    # was idle; nothing while nothing changed; "d" at once, the previous snapshot being old
    assert sent == [(0.0, 1), (0.5, 3), (3.6, 4)]
