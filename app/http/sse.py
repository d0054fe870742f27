"""Server-Sent Events as OpenAI's clients read them: ``data: <json>\\n\\n`` … ``data: [DONE]\\n\\n``.

This module only writes events: what each output becomes is the adapters' job, and where the
outputs come from is the request stream's. A stream that fails after it started cannot change
its status any more: it sends ``data: {"error": {"message", "type", "code"}}`` and then
``data: [DONE]``, so that every client sees the end of the stream (the openai SDK raises an
APIError on the error event).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Generic, Protocol, TypeVar

import msgspec
import structlog
import trio

from app.http.errors import ApiError
from app.http.primitives import Send

DONE = b"data: [DONE]\n\n"
MAX_WRITE_BYTES = 256 * 1024  # a response catching up writes at most about this much at once

_HEADERS = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell nginx-like proxies not to hold events back
)

_log = structlog.get_logger("app.http.sse")

T = TypeVar("T")  # what the stream reads (a ChoiceOutput)
T_co = TypeVar("T_co", covariant=True)


class Outputs(Protocol[T_co]):
    """What an EventStream reads: an async iterator (RequestStream is one) that also hands out,
    without waiting, the outputs that have arrived already."""

    def __aiter__(self) -> AsyncIterator[T_co]: ...

    async def __anext__(self) -> T_co: ...

    def next_nowait(self) -> T_co:
        """The next output if it is here; trio.WouldBlock otherwise (errors wait for __anext__)."""
        ...


def event(payload: bytes) -> bytes:
    """One SSE event holding ``payload`` (JSON: one line, so a single ``data:`` field)."""
    return b"data: " + payload + b"\n\n"


class EventStream(Generic[T]):
    """A streaming response: ``to_events`` turns each output into the Structs sent as events.

    ``to_events`` raises ApiError to end the stream with an error event (an aborted request),
    and so does the reading of ``outputs`` (a failed request).
    """

    status = 200

    def __init__(
        self,
        outputs: Outputs[T],
        to_events: Callable[[T], Sequence[msgspec.Struct]],
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        self.headers = headers if headers is not None else []
        self._outputs = outputs
        self._to_events = to_events

    async def send_to(self, send: Send) -> None:
        head = [*_HEADERS, *((k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers)]
        await send({"type": "http.response.start", "status": self.status, "headers": head})
        try:
            async for output in self._outputs:
                await self._send_events(send, output)
        except ApiError as exc:
            await self._send_error(send, exc)
        except Exception:
            _log.exception("stream failed")
            await self._send_error(send, ApiError(500, "Internal server error while streaming."))
        await send({"type": "http.response.body", "body": DONE, "more_body": False})

    async def _send_events(self, send: Send, output: T) -> None:
        """The events of ``output``, and of every output already here behind it, in one write.

        A response that keeps up writes one output at a time. One that fell behind (a scheduler
        step makes an output for every stream at once, and each write to a socket costs tens of
        microseconds of hypercorn, h11 and a system call) catches up a write per backlog instead
        of a write per output; the events and their order are the same. An error raised for a
        later output is raised after the events before it are written.
        """
        pieces = [event(msgspec.json.encode(item)) for item in self._to_events(output)]
        failure: Exception | None = None
        take = self._outputs.next_nowait
        size = sum(map(len, pieces))
        while size < MAX_WRITE_BYTES:
            try:
                more = [event(msgspec.json.encode(item)) for item in self._to_events(take())]
            except trio.WouldBlock:
                break
            except Exception as exc:  # the events so far go first; send_to then ends the stream
                failure = exc
                break
            pieces += more
            size += sum(map(len, more))
        if pieces:
            await send({"type": "http.response.body", "body": b"".join(pieces), "more_body": True})
        if failure is not None:
            raise failure

    @staticmethod
    async def _send_error(send: Send, error: ApiError) -> None:
        payload = event(msgspec.json.encode(error.stream_event()))
        await send({"type": "http.response.body", "body": payload, "more_body": True})
