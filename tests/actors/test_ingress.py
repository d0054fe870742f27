"""The ingress's Backend surface (submit, release, abort, fail_all), with the channels to and
from the actors replaced by in-memory ones: submission, answers routed in order, errors, aborts."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from app.actors.ingress import Ingress
from app.actors.queue_gate import QueueGate
from app.http.backend import Answer, ModelCard, RequestError, ServerError, ServerState
from app.ipc.messages import (
    AbortRequest,
    Finish,
    FinishReason,
    GenerateRequest,
    RequestRejected,
    SamplingParams,
    TextBatch,
    TextOutput,
    Usage,
    pack_tokens,
)

MODEL = ModelCard(name="m", path="/m", context_length=64, vocab_size=100, architecture="none")


class Recorder:
    """Stands in for the channel to the tokenizer: keeps what was sent."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, message: object) -> None:
        self.sent.append(message)

    def aborts(self) -> list[AbortRequest]:
        return [m for m in self.sent if isinstance(m, AbortRequest)]


class Actors:
    """An ingress whose actors are in-memory channels: what it sends to the tokenizer is
    recorded, and the tests send it the detokenizer's outputs and the tokenizer's rejections."""

    def __init__(self, gate: QueueGate = QueueGate(None)) -> None:
        self.to_tokenizer = Recorder()
        self._from_tokenizer, tokenizer_to_ingress = trio.open_memory_channel[object](math.inf)
        self._from_detokenizer, detokenizer_to_ingress = trio.open_memory_channel[object](math.inf)
        endpoints = SimpleNamespace(senders={"to_tokenizer": self.to_tokenizer},
                                    receivers={"tokenizer_to_ingress": tokenizer_to_ingress,
                                               "detokenizer_to_ingress": detokenizer_to_ingress})
        self.ingress = Ingress(endpoints, MODEL, {}, gate)  # type: ignore[arg-type]
        self.ingress.set_state(ServerState.SERVING)

    async def outputs(self, *outputs: TextOutput) -> None:
        """One TextBatch from the detokenizer, routed before this returns."""
        await self._from_detokenizer.send(TextBatch(outputs))
        await trio.testing.wait_all_tasks_blocked()

    async def reject(self, rid: str, message: str) -> None:
        await self._from_tokenizer.send(RequestRejected(rid, message, 400, "prompt"))
        await trio.testing.wait_all_tasks_blocked()


@pytest.fixture
async def actors() -> AsyncIterator[Actors]:
    actors = Actors()
    async with actors.ingress.routing():
        yield actors


def request(rid: str = "r1") -> GenerateRequest:
    return GenerateRequest(rid, SamplingParams(max_new_tokens=3), input_ids=pack_tokens([1, 2]))


def output(rid: str, i: int, final: bool = False) -> TextOutput:
    finish = Finish(FinishReason.LENGTH) if final else None
    return TextOutput(rid, f"t{i}", pack_tokens([i]), finish, Usage(2, i + 1) if final else None)


def channel() -> tuple[trio.MemorySendChannel[Answer], trio.MemoryReceiveChannel[Answer]]:
    return trio.open_memory_channel[Answer](math.inf)


async def test_answers_arrive_in_order_and_the_channel_ends_after_the_final_one(actors):
    ingress = actors.ingress
    send, receive = channel()
    await ingress.submit(request(), send)
    assert actors.to_tokenizer.sent == [request()] and "r1" in ingress.pending
    await actors.outputs(output("r1", 0), output("r1", 1))
    await actors.outputs(output("r1", 2, final=True), output("r1", 3))
    assert [o.text async for o in receive] == ["t0", "t1", "t2"]  # nothing after the final one
    assert "r1" in ingress.pending  # until its reader releases it
    await ingress.release("r1")
    assert ingress.pending == {} and actors.to_tokenizer.aborts() == []


async def test_releasing_before_the_final_output_aborts_the_request_once(actors):
    ingress = actors.ingress
    send, receive = channel()
    await ingress.submit(request(), send)
    await actors.outputs(output("r1", 0))
    await ingress.release("r1")
    await ingress.release("r1")  # releasing twice is harmless
    await actors.outputs(output("r1", 1))  # arriving after the reader left: dropped
    assert [a.rid for a in actors.to_tokenizer.aborts()] == ["r1"]
    assert [o.text async for o in receive] == ["t0"]
    assert ingress.pending == {}


async def test_a_release_from_a_cancelled_reader_still_sends_the_abort(actors):
    send, _ = channel()
    await actors.ingress.submit(request(), send)
    with trio.CancelScope() as scope:
        scope.cancel()
        await actors.ingress.release("r1")
    assert [a.rid for a in actors.to_tokenizer.aborts()] == ["r1"]


@pytest.mark.parametrize("failure", ["rejected", "server"])
async def test_a_failure_is_the_last_answer_and_needs_no_abort(actors, failure):
    ingress = actors.ingress
    send, receive = channel()
    await ingress.submit(request(), send)
    await actors.outputs(output("r1", 0))
    if failure == "rejected":
        await actors.reject("r1", "no room")
    else:
        ingress.fail_all(ServerError("an actor died", 500))
    await actors.outputs(output("r1", 1))
    answers = [answer async for answer in receive]
    assert answers[0].text == "t0" and len(answers) == 2
    error = answers[1].error
    if failure == "rejected":
        assert isinstance(error, RequestError) and (error.message, error.param) == ("no room", "prompt")
    else:
        assert isinstance(error, ServerError) and error.message == "an actor died"
    await ingress.release("r1")
    assert ingress.pending == {} and actors.to_tokenizer.aborts() == []


async def test_after_a_failure_new_requests_are_refused_with_it(actors):
    actors.ingress.fail_all(ServerError("an actor died", 500))
    with pytest.raises(ServerError, match="an actor died"):
        await actors.ingress.submit(request(), channel()[0])
    assert actors.to_tokenizer.sent == [] and actors.ingress.pending == {}


async def test_a_duplicate_request_id_is_refused_and_the_first_request_keeps_going(actors):
    ingress = actors.ingress
    first, receive = channel()
    await ingress.submit(request(), first)
    with pytest.raises(RequestError, match="duplicate request id") as refused:
        await ingress.submit(request(), channel()[0])
    assert refused.value.param == "rid"
    await actors.outputs(output("r1", 0, final=True))
    assert [o.text async for o in receive] == ["t0"]
    await ingress.release("r1")
    assert ingress.pending == {} and actors.to_tokenizer.aborts() == []
    assert actors.to_tokenizer.sent == [request()]


async def test_a_stopping_server_refuses_before_submitting(actors):
    actors.ingress.set_state(ServerState.STOPPING)
    with pytest.raises(RequestError) as refused:
        await actors.ingress.submit(request(), channel()[0])
    assert refused.value.status_code == 503
    assert actors.to_tokenizer.sent == [] and actors.ingress.pending == {}


async def test_abort_by_the_request_id_reaches_every_choice(actors):
    for rid in ("c-0", "c-1", "other"):
        await actors.ingress.submit(request(rid), channel()[0])
    assert await actors.ingress.abort("c")
    assert not await actors.ingress.abort("missing")
    aborts = actors.to_tokenizer.aborts()
    assert sorted(a.rid for a in aborts) == ["c-0", "c-1"] and all(a.status_code == 499 for a in aborts)


async def test_a_message_the_channel_cannot_encode_is_a_400_and_nothing_reaches_the_ring():
    """Over a real shared-memory channel: an integer past 64 bits (which the HTTP schemas refuse
    first) is refused whole by the encoder; the next request goes through."""
    from app.actors.endpoints import Endpoints
    from app.actors.graph import ChannelGraph

    graph = ChannelGraph.create(capacity=1 << 16)
    try:
        with Endpoints("ingress", graph.specs_for("ingress")) as ours, \
                Endpoints("tokenizer", graph.specs_for("tokenizer")) as tokenizer:
            ingress = Ingress(ours, MODEL, {})  # type: ignore[arg-type]
            ingress.set_state(ServerState.SERVING)
            huge = GenerateRequest("huge", SamplingParams(max_new_tokens=2**64), input_ids=pack_tokens([1]))
            with pytest.raises(RequestError) as refused:
                await ingress.submit(huge, channel()[0])
            assert ingress.pending == {}
            inbox = tokenizer.receivers["to_tokenizer"]
            with pytest.raises(trio.WouldBlock):
                inbox.receive_nowait()
            await ingress.submit(request("fine"), channel()[0])
            with trio.fail_after(5):
                arrived = await inbox.receive()
    finally:
        graph.close()

    assert refused.value.status_code == 400
    assert refused.value.message == ("The request holds a value the server cannot carry: "
                                     "can't serialize ints < -2**63 or > 2**64 - 1")
    assert arrived == request("fine")


def test_the_gate_is_open_without_a_queue_limit_or_with_priorities():
    assert QueueGate.for_limits(None, 4, False).bound is None
    assert QueueGate.for_limits(2, 4, True).bound is None  # an arrival may evict: the scheduler decides
    gate = QueueGate.for_limits(2, 4, False)
    assert gate.bound == 6
    assert [gate.refuses(n) for n in (0, 5, 6, 7)] == [False, False, True, True]
    assert not QueueGate(None).refuses(10**6)


async def test_the_gate_refuses_once_running_plus_queued_are_unfinished_and_reopens_as_they_finish():
    """max_running 1 + max_queued 2: the fourth unfinished request is refused without being sent;
    a finished one (its last answer delivered, not yet released) and a released one free a place."""
    actors = Actors(QueueGate.for_limits(2, 1, False))
    ingress = actors.ingress
    async with ingress.routing():
        for rid in ("a", "b", "c"):
            await ingress.submit(request(rid), channel()[0])
        with pytest.raises(RequestError) as refused:
            await ingress.submit(request("d"), channel()[0])
        assert (refused.value.status_code, refused.value.message) == (503, "The request queue is full.")
        assert "d" not in ingress.pending and [m.rid for m in actors.to_tokenizer.sent] == ["a", "b", "c"]
        assert (ingress.unfinished, ingress.refused_at_gate) == (3, 1)

        await actors.outputs(output("a", 0, final=True))  # finished, its reader has not released it yet
        assert ingress.unfinished == 2
        await ingress.submit(request("d"), channel()[0])
        await ingress.release("b")  # a client that left: aborted, no longer counted
        await ingress.release("a")
        assert ingress.unfinished == 2
        await ingress.submit(request("e"), channel()[0])
        with pytest.raises(RequestError):
            await ingress.submit(request("f"), channel()[0])
        ingress.fail_all(ServerError("an actor died", 500))
        assert ingress.unfinished == 0 and ingress.refused_at_gate == 2
