"""Bounded reads over real sockets: a request body has ``body_read_timeout_s`` to arrive (then 408
and the connection is closed), and connections past ``max_connections`` get a raw 503 and are
closed (at most ``MAX_REFUSING`` answered at once), while well-behaved clients keep being served.
A connection's place under the cap is freed as soon as its client closes it, an idle keep-alive
connection is closed after hypercorn's keep-alive timeout, and shutdown closes idle ones at once.

Raw trio socket streams play the clients that httpx cannot: bodies that trickle, never end or stop
short, and connections held open without a request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import NamedTuple

import httpx
import pytest
import trio
from echo_backend import EchoBackend
from hypercorn.config import Config

from app.http.asgi import make_app
from app.http.server import MAX_REFUSING, HttpBinding, serve_http
from app.shutdown import ShutdownDeadline

READ_TIMEOUT_S = 0.5  # the body deadline of every server in this file
HOST = "127.0.0.1"
BODY = b'{"prompt": "hello", "max_tokens": 3}'
TIMEOUT_408 = {
    "object": "error", "message": "The request body did not arrive within 0.5 s.",
    "type": "RequestTimeoutError", "param": None, "code": 408,
}
REFUSED_503 = {
    "object": "error", "message": "Too many open connections; retry shortly.",
    "type": "ServiceUnavailableError", "param": None, "code": 503,
}


class RawResponse(NamedTuple):
    status: int
    reason: str
    headers: dict[str, str]  # names lower-cased; each appears once in our answers
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


Serve = Callable[..., Awaitable[HttpBinding]]


@pytest.fixture
def serve_bounded(nursery: trio.Nursery, backend: EchoBackend) -> Serve:
    """``await serve_bounded(max_connections=N)``: the echo app with a 0.5 s body deadline, served
    for the rest of the test."""

    async def start(**options: object) -> HttpBinding:
        app = make_app(backend, body_read_timeout_s=READ_TIMEOUT_S)
        return await nursery.start(partial(serve_http, app, HOST, 0, **options))

    return start


def request_head(*, content_length: int | None = len(BODY), chunked: bool = False, path: str = "/v1/completions",
                 method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: test", "content-type: application/json"]
    if content_length is not None:
        lines.append(f"content-length: {content_length}")
    if chunked:
        lines.append("transfer-encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class Reader:
    """Reads HTTP/1.1 responses (with a content-length) off a raw stream, and its end."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def to_the_end(self) -> bytes:
        """Everything the server sends until it closes the connection."""
        while await self._more():
            pass
        return self.buffer

    async def _more(self) -> bytes:
        data = await self.stream.receive_some(65536)
        self.buffer += data
        return data

    async def response(self) -> RawResponse:
        while b"\r\n\r\n" not in self.buffer:
            assert await self._more(), f"the connection closed before a whole head: {self.buffer!r}"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        version, status, reason = status_line.split(" ", 2)
        assert version == "HTTP/1.1"
        headers = {}
        for line in lines:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            assert await self._more(), "the connection closed before the whole body"
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return RawResponse(int(status), reason, headers, body)

    async def closed(self) -> bool:
        """Whether the server closes the connection with nothing more to say (``recv`` gives b"")."""
        return not self.buffer and not await self._more()


async def trickle(stream: trio.SocketStream, pieces: list[bytes] | None, interval_s: float,
                  filler: bytes = b" ") -> None:
    """Send ``pieces`` one every ``interval_s`` (``filler`` forever when None); stop quietly once
    the server has closed the connection."""
    try:
        i = 0
        while pieces is None or i < len(pieces):
            await stream.send_all(filler if pieces is None else pieces[i])
            i += 1
            await trio.sleep(interval_s)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


@pytest.fixture
async def connect() -> AsyncIterator[Callable[[HttpBinding], Awaitable[trio.SocketStream]]]:
    """``await connect(binding)``: a raw connection, closed at the end of the test."""
    streams: list[trio.SocketStream] = []

    async def open_one(binding: HttpBinding) -> trio.SocketStream:
        stream = await trio.open_tcp_stream(binding.host, binding.port)
        streams.append(stream)
        return stream

    yield open_one
    for stream in streams:
        await trio.aclose_forcefully(stream)


async def assert_served(binding: HttpBinding) -> None:
    """A normal request on a fresh connection gets its completion."""
    async with httpx.AsyncClient(base_url=binding.url, timeout=5) as client:
        response = await client.post("/v1/completions", content=BODY, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == "hel"


async def cut_by_the_body_deadline(stream: trio.SocketStream, sending: Callable[[], Awaitable[None]]) -> RawResponse:
    """Run ``sending`` beside reading the answer; asserts it is a 408 that came at the deadline
    (within a bound), and that the server then closed the connection."""
    reader = Reader(stream)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sending)
        started = trio.current_time()
        with trio.fail_after(READ_TIMEOUT_S + 2.0):
            response = await reader.response()
            elapsed = trio.current_time() - started
            assert await reader.closed()
        nursery.cancel_scope.cancel()
    assert READ_TIMEOUT_S - 0.05 <= elapsed <= READ_TIMEOUT_S + 1.0, elapsed
    assert response.status == 408
    assert response.headers["connection"] == "close"
    assert response.headers["content-type"] == "application/json"
    assert response.json() == TIMEOUT_408
    return response


async def test_a_trickled_body_gets_408_at_the_deadline_then_the_connection_closes(serve_bounded, connect, backend):
    binding = await serve_bounded()
    stream = await connect(binding)
    await stream.send_all(request_head(content_length=100))
    # one byte every 0.2 s: 100 bytes would take 20 s
    await cut_by_the_body_deadline(stream, partial(trickle, stream, None, 0.2, filler=b" "))
    assert backend.requests == []  # the handler never ran
    await assert_served(binding)


async def test_a_chunked_body_that_never_ends_gets_408_then_the_connection_closes(serve_bounded, connect, backend):
    binding = await serve_bounded()
    stream = await connect(binding)
    await stream.send_all(request_head(content_length=None, chunked=True))
    await cut_by_the_body_deadline(stream, partial(trickle, stream, None, 0.05, filler=b"1\r\n \r\n"))
    assert backend.requests == []
    await assert_served(binding)


async def test_a_body_shorter_than_its_content_length_gets_408_then_the_connection_closes(
        serve_bounded, connect, backend):
    binding = await serve_bounded()
    stream = await connect(binding)
    await stream.send_all(request_head(content_length=len(BODY) + 10) + BODY)  # then silence
    await cut_by_the_body_deadline(stream, trio.sleep_forever)
    assert backend.requests == []
    await assert_served(binding)


async def test_a_body_sent_slowly_within_the_deadline_is_served(serve_bounded, connect, backend):
    binding = await serve_bounded()
    stream = await connect(binding)
    await stream.send_all(request_head())
    thirds = [BODY[:10], BODY[10:20], BODY[20:]]
    with trio.fail_after(3):
        await trickle(stream, thirds, 0.1)  # the last piece leaves at 0.2 s, within 0.5 s
        response = await Reader(stream).response()
    assert response.status == 200
    assert response.json()["choices"][0]["text"] == "hel"
    assert [EchoBackend.prompt_of(r) for r in backend.requests] == ["hello"]


async def test_past_the_cap_a_connection_gets_a_raw_503_and_a_freed_slot_serves_again(serve_bounded, connect):
    binding = await serve_bounded(max_connections=4)
    held: list[trio.SocketStream] = []
    for _ in range(4):
        # one answered request each proves the connection is counted; then it idles, kept alive
        stream = await connect(binding)
        await stream.send_all(request_head(method="GET", path="/health", content_length=None))
        with trio.fail_after(3):
            assert (await Reader(stream).response()).status == 200
        held.append(stream)

    extra = await connect(binding)
    await extra.send_all(request_head(method="GET", path="/health", content_length=None))
    reader = Reader(extra)
    with trio.fail_after(3):
        refused = await reader.response()
        assert await reader.closed()
    assert (refused.status, refused.reason) == (503, "Service Unavailable")
    assert refused.headers == {
        "content-type": "application/json", "content-length": str(len(refused.body)),
        "retry-after": "1", "connection": "close",
    }
    assert refused.json() == REFUSED_503

    await held.pop().aclose()  # frees a slot as soon as the server reads the end
    closed = trio.current_time()
    statuses: list[int] = []
    with trio.fail_after(3):
        no_reuse = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=binding.url, timeout=3, limits=no_reuse) as client:
            while not statuses or statuses[-1] != 200:
                statuses.append((await client.get("/health")).status_code)
                if statuses[-1] != 200:
                    await trio.sleep(0.02)
    # well before hypercorn's keep-alive timeout (5 s), which once held a closed connection's slot
    assert trio.current_time() - closed < 1.0
    assert set(statuses) <= {200, 503}
    # the held connections were never disturbed: each still serves a request
    for stream in held:
        await stream.send_all(request_head(method="GET", path="/health", content_length=None))
        with trio.fail_after(3):
            assert (await Reader(stream).response()).status == 200


async def test_a_flood_past_the_cap_is_answered_at_most_max_refusing_at_a_time(serve_bounded, connect):
    binding = await serve_bounded(max_connections=1)
    held = Reader(await connect(binding))
    await held.stream.send_all(request_head(method="GET", path="/health", content_length=None))
    with trio.fail_after(3):
        assert (await held.response()).status == 200
    # none of them closes: each answer holds its descriptor for the refusal's whole second
    flood = [Reader(await connect(binding)) for _ in range(MAX_REFUSING + 6)]
    answers: list[bytes] = []

    async def read(reader: Reader) -> None:
        answers.append(await reader.to_the_end())

    with trio.fail_after(3):
        async with trio.open_nursery() as nursery:
            for reader in flood:
                nursery.start_soon(read, reader)
    refusals = [answer for answer in answers if answer]
    assert (len(refusals), answers.count(b"")) == (MAX_REFUSING, 6)  # the rest closed unanswered
    assert all(answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") for answer in refusals)
    await held.stream.send_all(request_head(method="GET", path="/health", content_length=None))
    assert (await held.response()).status == 200


async def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(
        serve_bounded, connect, monkeypatch):
    # hypercorn's idle timer restarts inside the send of a response's last message, when the app's
    # disconnect watcher wakes; it used to be cancelled there, leaving the connection open for good
    monkeypatch.setattr(Config, "keep_alive_timeout", 0.3)
    binding = await serve_bounded(max_connections=2)
    reader = Reader(await connect(binding))
    with trio.fail_after(3):
        for _ in range(2):  # the timer restarts after each answer
            await reader.stream.send_all(request_head() + BODY)
            assert (await reader.response()).status == 200
        answered = trio.current_time()
        assert await reader.closed()
    assert 0.25 <= trio.current_time() - answered <= 1.5


async def test_the_cap_counts_connections_not_requests(serve_bounded, connect):
    binding = await serve_bounded(max_connections=1)
    stream = await connect(binding)
    reader = Reader(stream)
    with trio.fail_after(5):
        for i in range(20):
            await stream.send_all(request_head() + BODY)
            response = await reader.response()
            assert (i, response.status, response.json()["choices"][0]["text"]) == (i, 200, "hel")
        # while that one is open, a second connection is the one too many
        other = Reader(await connect(binding))
        refused = await other.response()
        assert refused.status == 503 and await other.closed()
        await stream.send_all(request_head() + BODY)
        assert (await reader.response()).status == 200


async def test_shutdown_with_idle_keep_alive_connections_returns_at_once(backend, connect):
    shutdown = trio.Event()
    graceful_timeout_s = 10.0
    app = make_app(backend, body_read_timeout_s=READ_TIMEOUT_S)
    readers: list[Reader] = []
    with trio.fail_after(graceful_timeout_s / 2):
        async with trio.open_nursery() as nursery:
            binding = await nursery.start(partial(serve_http, app, HOST, 0, shutdown=shutdown,
                                                  deadline=ShutdownDeadline(graceful_timeout_s), max_connections=8))
            for _ in range(3):  # answered once, then idle
                reader = Reader(await connect(binding))
                await reader.stream.send_all(request_head() + BODY)
                assert (await reader.response()).status == 200
                readers.append(reader)
            silent = Reader(await connect(binding))  # connected, no request yet
            readers.append(silent)
            await trio.sleep(0.05)  # let the server accept the silent one
            started = trio.current_time()
            shutdown.set()
        elapsed = trio.current_time() - started
        for reader in readers:
            assert await reader.closed()
    assert elapsed < 1.0, elapsed
    with pytest.raises(OSError):
        await trio.open_tcp_stream(binding.host, binding.port)
