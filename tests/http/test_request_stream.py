"""RequestStream over the echo backend, without HTTP: the merged choices, outputs taken without
waiting, failures held for the next read, and every choice released (the unfinished aborted)."""

from __future__ import annotations

import pytest
import trio
from echo_backend import EchoBackend

from app.http.backend import Answer
from app.http.errors import ApiError
from app.http.request_stream import ChoiceOutput, RequestStream
from app.ipc.messages import GenerateRequest, SamplingParams


def request(rid: str, prompt: str, max_tokens: int = 16) -> GenerateRequest:
    return GenerateRequest(rid, SamplingParams(max_new_tokens=max_tokens), text=prompt)


async def in_flight(backend: EchoBackend) -> int:
    return (await backend.server_info())["requests_in_flight"]


def texts(items: list[ChoiceOutput], choices: int) -> list[str]:
    return ["".join(item.output.text for item in items if item.index == i) for i in range(choices)]


async def test_outputs_already_here_are_taken_without_waiting_in_arrival_order(backend):
    backend.max_tokens_of = {"r-1": 2}
    async with RequestStream(backend, [request("r", "abc")], n=2) as stream:
        for rid in ("r-0", "r-1"):
            await backend.answered[rid].wait()
        taken = []
        while True:
            try:
                taken.append(stream.next_nowait())
            except trio.WouldBlock:
                break
        with pytest.raises(StopAsyncIteration):  # after every choice's final output
            await anext(stream)
    assert stream.choices == 2
    assert texts(taken, 2) == ["abc", "ab"]
    assert [item.output.rid for item in taken] == [f"r-{item.index}" for item in taken]
    assert sum(item.output.finish is not None for item in taken) == 2
    assert await in_flight(backend) == 0  # both released
    assert not any(event.is_set() for event in backend.closed_early.values())


async def test_a_batch_of_prompts_answers_choice_p_times_n_plus_i(backend):
    prompts = [request("b", "xy"), request("b", "z")]
    async with RequestStream(backend, prompts, n=2) as stream:
        taken = [item async for item in stream]
    assert texts(taken, 4) == ["xy", "xy", "z", "z"]
    assert sorted(r.rid for r in backend.requests) == ["b-0", "b-1", "b-2", "b-3"]


async def test_a_failure_waits_behind_the_outputs_before_it_and_is_raised_by_the_next_read(backend):
    backend.fail_after = 2
    async with RequestStream(backend, [request("f", "abcdef")]) as stream:
        await backend.answered["f"].wait()
        assert [stream.next_nowait().output.text for _ in range(2)] == ["a", "b"]
        for _ in range(2):  # held, not lost, however often the reader asks
            with pytest.raises(trio.WouldBlock):
                stream.next_nowait()
        with pytest.raises(ApiError) as failed:
            await anext(stream)
    assert (failed.value.status, failed.value.message) == (500, "the scheduler died")
    assert not backend.closed_early["f"].is_set()  # a failed request has nothing left to abort


async def test_leaving_early_releases_every_choice_and_aborts_the_unfinished(backend):
    backend.delay_s = 0.02
    backend.max_tokens_of = {"e-0": 1}
    async with RequestStream(backend, [request("e", "a long prompt")], n=2) as stream:
        taken = [await anext(stream) for _ in range(2)]
        await backend.answered["e-0"].wait()
    assert {item.index for item in taken} == {0, 1}
    assert backend.closed_early["e-1"].is_set() and not backend.closed_early["e-0"].is_set()
    assert await in_flight(backend) == 0


async def test_a_reader_cancelled_while_opening_releases_every_choice(backend):
    backend.delay_s = 30
    with trio.move_on_after(0.1):
        async with RequestStream(backend, [request("c", "abc")], n=3):
            pytest.fail("no choice has answered yet")
    assert all(backend.closed_early[f"c-{i}"].is_set() for i in range(3))
    assert await in_flight(backend) == 0


async def test_a_choice_refused_at_submission_fails_the_request_and_releases_the_others(backend):
    send, _ = trio.open_memory_channel[Answer](10)
    await backend.submit(request("d-1", "taken"), send)  # d-1's rid is in use: the second choice is refused
    with pytest.raises(ApiError) as refused:
        async with RequestStream(backend, [request("d", "abc")], n=3):
            pass
    assert (refused.value.status, refused.value.param) == (400, "rid")
    assert [r.rid for r in backend.requests] == ["d-1", "d-0"]  # the third was never submitted
    assert backend.closed_early["d-0"].is_set()


class LetsGo:
    """A backend that closes every request's channel without answering."""

    async def submit(self, request: GenerateRequest, answers: trio.MemorySendChannel[Answer]) -> None:
        answers.close()

    async def release(self, rid: str) -> None:
        pass


async def test_answers_that_end_without_a_final_output_are_a_500():
    with pytest.raises(ApiError) as failed:
        async with RequestStream(LetsGo(), [request("g", "abc")]):  # type: ignore[arg-type]
            pass
    assert failed.value.status == 500 and "without a final answer" in failed.value.message
