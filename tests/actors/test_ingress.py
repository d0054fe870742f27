"""The ingress's Backend surface (submit, release, abort, fail_all), with the channels to the
actors replaced by in-memory stand-ins: submission, answers in order, errors, aborts."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from app.actors.ingress import Ingress
from app.http.backend import Answer, Failure, ModelCard, RequestError, ServerError, ServerState
from app.ipc.messages import (
    AbortRequest,
    Finish,
    FinishReason,
    GenerateRequest,
    SamplingParams,
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


def make_ingress() -> tuple[Ingress, Recorder]:
    to_tokenizer = Recorder()
    endpoints = SimpleNamespace(senders={"to_tokenizer": to_tokenizer},
                                receivers={"tokenizer_to_ingress": None, "detokenizer_to_ingress": None})
    ingress = Ingress(endpoints, MODEL, {})  # type: ignore[arg-type]
    ingress.set_state(ServerState.SERVING)
    return ingress, to_tokenizer


def request(rid: str = "r1") -> GenerateRequest:
    return GenerateRequest(rid, SamplingParams(max_new_tokens=3), input_ids=pack_tokens([1, 2]))


def output(rid: str, i: int, final: bool = False) -> TextOutput:
    finish = Finish(FinishReason.LENGTH) if final else None
    return TextOutput(rid, f"t{i}", pack_tokens([i]), finish, Usage(2, i + 1) if final else None)


def deliver(ingress: Ingress, answer: Answer) -> None:
    """As the routing task passes on what the detokenizer and the tokenizer send."""
    last = isinstance(answer, Failure) or answer.finish is not None
    ingress._deliver(answer.rid, answer, last)


def channel() -> tuple[trio.MemorySendChannel[Answer], trio.MemoryReceiveChannel[Answer]]:
    return trio.open_memory_channel[Answer](math.inf)


def aborts(recorder: Recorder) -> list[AbortRequest]:
    return [m for m in recorder.sent if isinstance(m, AbortRequest)]


async def test_answers_arrive_in_order_and_the_channel_ends_after_the_final_one():
    ingress, to_tokenizer = make_ingress()
    send, receive = channel()
    await ingress.submit(request(), send)
    assert to_tokenizer.sent == [request()] and "r1" in ingress.pending
    for answer in (output("r1", 0), output("r1", 1), output("r1", 2, final=True), output("r1", 3)):
        deliver(ingress, answer)
    assert [o.text async for o in receive] == ["t0", "t1", "t2"]  # nothing after the final one
    assert "r1" in ingress.pending  # until its reader releases it
    await ingress.release("r1")
    assert ingress.pending == {} and aborts(to_tokenizer) == []


async def test_releasing_before_the_final_output_aborts_the_request_once():
    ingress, to_tokenizer = make_ingress()
    send, receive = channel()
    await ingress.submit(request(), send)
    deliver(ingress, output("r1", 0))
    await ingress.release("r1")
    await ingress.release("r1")  # releasing twice is harmless
    deliver(ingress, output("r1", 1))  # arriving after the reader left: dropped
    assert [a.rid for a in aborts(to_tokenizer)] == ["r1"]
    assert [o.text async for o in receive] == ["t0"]
    assert ingress.pending == {}


async def test_a_release_from_a_cancelled_reader_still_sends_the_abort():
    ingress, to_tokenizer = make_ingress()
    send, _ = channel()
    await ingress.submit(request(), send)
    with trio.CancelScope() as scope:
        scope.cancel()
        await ingress.release("r1")
    assert [a.rid for a in aborts(to_tokenizer)] == ["r1"]


@pytest.mark.parametrize("failure", ["rejected", "server"])
async def test_a_failure_is_the_last_answer_and_needs_no_abort(failure):
    ingress, to_tokenizer = make_ingress()
    send, receive = channel()
    await ingress.submit(request(), send)
    deliver(ingress, output("r1", 0))
    if failure == "rejected":
        deliver(ingress, Failure("r1", RequestError("no room", 400, "prompt")))
    else:
        ingress.fail_all(ServerError("an actor died", 500))
    deliver(ingress, output("r1", 1))
    answers = [answer async for answer in receive]
    assert answers[0].text == "t0" and len(answers) == 2
    error = answers[1].error
    assert isinstance(error, RequestError if failure == "rejected" else ServerError)
    await ingress.release("r1")
    assert ingress.pending == {} and aborts(to_tokenizer) == []


async def test_after_a_failure_new_requests_are_refused_with_it():
    ingress, to_tokenizer = make_ingress()
    ingress.fail_all(ServerError("an actor died", 500))
    with pytest.raises(ServerError, match="an actor died"):
        await ingress.submit(request(), channel()[0])
    assert to_tokenizer.sent == [] and ingress.pending == {}


async def test_a_duplicate_request_id_is_refused_and_the_first_request_keeps_going():
    ingress, to_tokenizer = make_ingress()
    first, receive = channel()
    await ingress.submit(request(), first)
    with pytest.raises(RequestError, match="duplicate request id") as refused:
        await ingress.submit(request(), channel()[0])
    assert refused.value.param == "rid"
    deliver(ingress, output("r1", 0, final=True))
    assert [o.text async for o in receive] == ["t0"]
    await ingress.release("r1")
    assert ingress.pending == {} and aborts(to_tokenizer) == []
    assert to_tokenizer.sent == [request()]


async def test_a_stopping_server_refuses_before_submitting():
    ingress, to_tokenizer = make_ingress()
    ingress.set_state(ServerState.STOPPING)
    with pytest.raises(RequestError) as refused:
        await ingress.submit(request(), channel()[0])
    assert refused.value.status_code == 503
    assert to_tokenizer.sent == [] and ingress.pending == {}


async def test_abort_by_the_request_id_reaches_every_choice():
    ingress, to_tokenizer = make_ingress()
    for rid in ("c-0", "c-1", "other"):
        await ingress.submit(request(rid), channel()[0])
    assert await ingress.abort("c")
    assert not await ingress.abort("missing")
    assert sorted(a.rid for a in aborts(to_tokenizer)) == ["c-0", "c-1"]
    assert all(a.status_code == 499 for a in aborts(to_tokenizer))


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
