"""SSE responses that fall behind: every output already here is written in one piece, with the
same events in the same order as one write per output, and errors after the events before them."""

from __future__ import annotations

import json
from collections import deque
from typing import Any

import httpx
import msgspec
import pytest
import trio
from echo_backend import EchoBackend

from app.http.asgi import make_app
from app.http.errors import ApiError
from app.http.sse import DONE, MAX_WRITE_BYTES, EventStream


class Event(msgspec.Struct):
    n: int
    text: str = ""


class Ready:
    """An output iterator whose outputs have all arrived: ``next_nowait`` hands them out (unless
    ``nowait`` is False: then it never has one, as for a reader that keeps up), and ``failure``
    (if any) is raised by ``__anext__`` once they are gone, never by next_nowait."""

    def __init__(self, items: list[Any], failure: Exception | None = None, nowait: bool = True) -> None:
        self._items = deque(items)
        self._failure = failure
        self._nowait = nowait

    def __aiter__(self) -> Ready:
        return self

    async def __anext__(self) -> Any:
        await trio.lowlevel.checkpoint()
        if self._items:
            return self._items.popleft()
        if self._failure is not None:
            raise self._failure
        raise StopAsyncIteration

    def next_nowait(self) -> Any:
        if not self._items or not self._nowait:
            raise trio.WouldBlock
        return self._items.popleft()


async def written(outputs: Ready, to_events=lambda n: [Event(n)]) -> list[bytes]:
    """The bodies ``EventStream`` writes, in order (the response start left out)."""
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await EventStream(outputs, to_events).send_to(send)
    assert messages[0]["type"] == "http.response.start"
    assert all(m["more_body"] for m in messages[1:-1]) and not messages[-1]["more_body"]
    return [m["body"] for m in messages[1:]]


def payloads(bodies: list[bytes]) -> list[str]:
    raw = b"".join(bodies).decode()
    assert raw.endswith("\n\n")
    return [event.removeprefix("data: ") for event in raw[:-2].split("\n\n")]


async def test_outputs_already_here_go_out_in_one_write_with_the_same_events():
    behind = await written(Ready(list(range(6))))
    one_by_one = await written(Ready(list(range(6)), nowait=False))
    assert len(behind) == 1 + 1  # the six outputs' events, then [DONE]
    assert len(one_by_one) == 6 + 1
    assert b"".join(behind) == b"".join(one_by_one)
    assert payloads(behind) == [json.dumps({"n": n, "text": ""}, separators=(",", ":")) for n in range(6)] + ["[DONE]"]


async def test_an_output_with_several_events_or_none_keeps_them_in_order():
    def to_events(n: int) -> list[Event]:
        return [Event(n, text=str(i)) for i in range(n % 3)]  # 0, 1 or 2 events per output

    behind = await written(Ready(list(range(7))), to_events)
    one_by_one = await written(Ready(list(range(7)), nowait=False), to_events)
    assert b"".join(behind) == b"".join(one_by_one)


async def test_an_error_for_a_later_output_comes_after_the_events_before_it():
    def to_events(n: int) -> list[Event]:
        if n == 3:
            raise ApiError(400, "the request was aborted")
        return [Event(n)]

    bodies = await written(Ready(list(range(6))), to_events)
    events = payloads(bodies)
    assert [json.loads(e)["n"] for e in events[:3]] == [0, 1, 2]
    assert json.loads(events[3])["error"]["message"] == "the request was aborted"
    assert events[4:] == ["[DONE]"]
    assert bodies[-1] == DONE


async def test_a_failure_the_iterator_holds_ends_the_stream_after_every_output_before_it():
    bodies = await written(Ready([0, 1, 2], failure=ApiError(500, "an actor died")))
    events = payloads(bodies)
    assert [json.loads(e)["n"] for e in events[:3]] == [0, 1, 2]
    assert json.loads(events[3])["error"]["message"] == "an actor died"
    assert events[4:] == ["[DONE]"]


async def test_a_long_backlog_is_written_in_pieces_of_bounded_size():
    text = "x" * 5000
    count = 2 * MAX_WRITE_BYTES // len(text)

    def to_events(n: int) -> list[Event]:
        return [Event(n, text=text)]

    bodies = await written(Ready(list(range(count))), to_events)
    assert len(bodies) - 1 in (2, 3)  # twice the cap: two or three writes, then [DONE]
    assert all(len(body) < MAX_WRITE_BYTES + 2 * len(text) for body in bodies)
    assert [json.loads(e)["n"] for e in payloads(bodies)[:-1]] == list(range(count))


class BacklogBackend(EchoBackend):
    """The echo backend, with every answer of a request already in its channel when the response
    starts reading (as when a fast scheduler runs ahead of the HTTP layer)."""

    async def submit(self, request, answers):  # type: ignore[override]
        await super().submit(request, answers)
        await self.answered[request.rid].wait()


@pytest.mark.parametrize("n", [1, 2])
async def test_streams_that_fell_behind_give_the_text_and_usage_of_the_whole_answer(serve, nursery, n):
    backend = BacklogBackend()
    await nursery.start(backend.run)
    url = await serve(make_app(backend))
    body = {"model": "echo", "prompt": "hello there, world", "max_tokens": 12, "n": n, "seed": 1,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        whole = (await client.post("/v1/completions", json=body)).json()
        streamed = await client.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.split("\n\n") if line.startswith("data: {")]
    texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
             for i in range(n)]
    assert texts == [choice["text"] for choice in whole["choices"]] == ["hello there,"] * n
    usage_so_far = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert usage_so_far == sorted(usage_so_far) and usage_so_far[-1] == 12 * n
    assert chunks[-1]["usage"] == whole["usage"]
    assert streamed.text.endswith("data: [DONE]\n\n")
