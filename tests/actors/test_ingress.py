"""The ingress's per-request outputs (RequestOutputs), with the channels to the actors replaced
by in-memory stand-ins: submission, outputs taken with and without waiting, errors, aborts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio
import trio.testing

from app.actors.ingress import Ingress
from app.http.backend import ModelCard, RequestError, ServerError, ServerState
from app.ipc.messages import (
    AbortRequest,
    Finish,
    FinishReason,
    GenerateRequest,
    RequestRejected,
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


def aborts(recorder: Recorder) -> list[AbortRequest]:
    return [m for m in recorder.sent if isinstance(m, AbortRequest)]


async def test_outputs_already_here_are_taken_without_waiting_and_in_order():
    ingress, to_tokenizer = make_ingress()
    outputs = ingress.generate(request())
    assert to_tokenizer.sent == []  # nothing is submitted before the first read
    with pytest.raises(trio.WouldBlock):
        outputs.next_nowait()
    async with trio.open_nursery() as nursery:
        first: list[TextOutput] = []

        async def read_first() -> None:
            first.append(await anext(outputs))

        nursery.start_soon(read_first)
        await trio.testing.wait_all_tasks_blocked()
        assert to_tokenizer.sent == [request()] and "r1" in ingress.pending
        ingress._deliver("r1", output("r1", 0))
    assert [o.text for o in first] == ["t0"]
    with pytest.raises(trio.WouldBlock):
        outputs.next_nowait()
    ingress._deliver("r1", output("r1", 1))
    ingress._deliver("r1", output("r1", 2, final=True))
    assert outputs.next_nowait().text == "t1"
    assert outputs.next_nowait().finish is not None
    with pytest.raises(trio.WouldBlock):  # nothing after the final output
        outputs.next_nowait()
    with pytest.raises(StopAsyncIteration):
        await anext(outputs)
    assert ingress.pending == {} and aborts(to_tokenizer) == []
    await ingress.wait_idle()  # returns at once: nothing pending


async def test_leaving_before_the_final_output_aborts_the_request_once():
    ingress, to_tokenizer = make_ingress()
    outputs = ingress.generate(request())
    taken: list[TextOutput] = []
    async with trio.open_nursery() as nursery:
        async def read() -> None:
            taken.append(await anext(outputs))

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        ingress._deliver("r1", output("r1", 0))
    ingress._deliver("r1", output("r1", 1))
    assert [o.text for o in taken] == ["t0"] and outputs.next_nowait().text == "t1"
    await outputs.aclose()
    await outputs.aclose()  # closing twice is harmless
    assert [a.rid for a in aborts(to_tokenizer)] == ["r1"]
    assert ingress.pending == {}


async def test_a_reader_cancelled_while_waiting_aborts_the_request():
    ingress, to_tokenizer = make_ingress()
    outputs = ingress.generate(request())
    with trio.move_on_after(0.05):
        await anext(outputs)  # nothing ever arrives
    assert [a.rid for a in aborts(to_tokenizer)] == ["r1"]
    assert ingress.pending == {}


@pytest.mark.parametrize("failure", ["rejected", "server"])
async def test_a_failure_is_never_taken_without_waiting_but_raised_by_the_next_read(failure):
    ingress, to_tokenizer = make_ingress()
    outputs = ingress.generate(request())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(anext, outputs)
        await trio.testing.wait_all_tasks_blocked()
        ingress._deliver("r1", output("r1", 0))
    ingress._deliver("r1", output("r1", 1))
    if failure == "rejected":
        ingress._deliver("r1", RequestRejected("r1", "no room", 400, "prompt"))
        expected: type[Exception] = RequestError
    else:
        ingress.fail_all(ServerError("an actor died", 500))
        expected = ServerError
    assert outputs.next_nowait().text == "t1"
    for _ in range(2):  # held, not lost, however often the reader asks
        with pytest.raises(trio.WouldBlock):
            outputs.next_nowait()
    with pytest.raises(expected):
        await anext(outputs)
    assert ingress.pending == {} and aborts(to_tokenizer) == []


async def test_a_duplicate_request_id_is_refused_and_the_first_request_keeps_going():
    ingress, to_tokenizer = make_ingress()
    first = ingress.generate(request())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(anext, first)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(RequestError, match="duplicate request id"):
            await anext(ingress.generate(request()))
        ingress._deliver("r1", output("r1", 0, final=True))
    assert "r1" in ingress.pending  # the first request's reader has not finished yet
    with pytest.raises(StopAsyncIteration):
        await anext(first)
    assert ingress.pending == {} and aborts(to_tokenizer) == []
    assert to_tokenizer.sent == [request()]


async def test_a_server_that_is_not_serving_refuses_before_submitting():
    ingress, to_tokenizer = make_ingress()
    ingress.set_state(ServerState.STOPPING)
    with pytest.raises(RequestError) as refused:
        await anext(ingress.generate(request()))
    assert refused.value.status_code == 503
    assert to_tokenizer.sent == [] and ingress.pending == {}


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
                await anext(ingress.generate(huge))
            inbox = tokenizer.receivers["to_tokenizer"]
            with pytest.raises(trio.WouldBlock):
                inbox.receive_nowait()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(anext, ingress.generate(request("fine")))
                with trio.fail_after(5):
                    arrived = await inbox.receive()
                nursery.cancel_scope.cancel()
    finally:
        graph.close()

    assert refused.value.status_code == 400
    assert refused.value.message == ("The request holds a value the server cannot carry: "
                                     "can't serialize ints < -2**63 or > 2**64 - 1")
    assert arrived == request("fine")
