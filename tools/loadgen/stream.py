"""One streamed completion and its figures, and a share of a level's requests sent on schedule.

Tokens are counted from the server's ``usage`` only (``stream_options.include_usage``: the final
usage chunk, or the usage in every chunk with ``continuous_usage_stats``), never from the text: a
random-weight model's tokens often decode to no text (or the server's tokenizer has fewer entries
than the model's vocabulary), and such a stream delivered its tokens all the same.
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import httpx
import msgspec
import trio


class RequestSpec(NamedTuple):
    prompt: list[int]  # token ids
    output_len: int  # max_tokens


class Target(NamedTuple):
    """What every request of a run sends besides its prompt."""

    model: str
    temperature: float
    ignore_eos: bool
    continuous_usage_stats: bool
    extra_body: dict[str, Any]


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    """The part of a completion chunk (or of an error event) that the benchmark reads."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None


decode_chunk = msgspec.json.Decoder(_Chunk).decode


class Outcome(NamedTuple):
    """One request's figures; ``error`` is None when it completed. ``sent_at`` and ``ended_at`` are
    ``time.perf_counter()`` readings (CLOCK_MONOTONIC on Linux: one clock for every process of
    the machine, so the records of several client processes share it). ``ttft_s`` is NaN when
    no chunk showed output before the end (see :class:`StreamState`)."""

    error: str | None
    sent_input_len: int
    asked_output_len: int
    input_tokens: int
    output_tokens: int
    ttft_s: float
    itls_s: list[float]
    e2e_s: float
    sent_at: float
    ended_at: float


class StreamState:
    """What one stream has shown so far; ``take`` reads a chunk arrived at ``now``.

    A chunk *shows output* when one of its choices has text, or when the usage it carries rose
    (``continuous_usage_stats``: a chunk for every new token, with or without text). TTFT is timed
    to the first such chunk and ITL between them; with only a final usage, a stream whose tokens
    all decode to no text shows none (the server sends no chunk for them), so it completes with
    its tokens counted but without a TTFT (``ttft_s`` NaN: the level's ``ttft_unknown``).
    """

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.first: float | None = None  # when the first chunk with output arrived
        self.last: float | None = None  # when the latest chunk with output arrived
        self.itls: list[float] = []
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None  # the latest usage's (None: no usage seen)
        self.usage_in_every_chunk = True  # until a chunk with output comes without a usage rise
        self.finish: str | None = None
        self.error: str | None = None

    def take(self, chunk: _Chunk, now: float) -> None:
        if chunk.error is not None:
            self.error = "stream_error"
            return
        rise = 0  # output tokens this chunk carries per its usage; 0 when it does not say
        if chunk.usage is not None:
            if chunk.usage.prompt_tokens is not None:
                self.prompt_tokens = chunk.usage.prompt_tokens
            if chunk.usage.completion_tokens is not None:
                rise = max(0, chunk.usage.completion_tokens - (self.completion_tokens or 0))
                self.completion_tokens = max(self.completion_tokens or 0, chunk.usage.completion_tokens)
        for choice in chunk.choices:
            self.finish = choice.finish_reason or self.finish
        has_text = any(choice.text for choice in chunk.choices)
        if not chunk.choices or not (has_text or rise):
            return  # the final usage-only chunk, or a chunk without output (a finish marker)
        if self.last is None:
            self.first = now
        else:
            k = rise if rise and self.usage_in_every_chunk else 1
            self.itls.extend([(now - self.last) / k] * k)
        self.last = now
        if rise == 0:
            self.usage_in_every_chunk = False

    def outcome(self, spec: RequestSpec, ended: float) -> Outcome:
        """The request's figures. Errors beyond the transport's: ``no_finish`` (no finish_reason),
        ``finish_abort``, ``no_usage`` (no usage in the whole stream: its tokens are unknown) and
        ``no_output`` (the usage says no token was delivered, although max_tokens >= 1 was asked)."""
        error = self.error
        if error is None and self.finish is None:
            error = "no_finish"
        if error is None and self.finish == "abort":
            error = "finish_abort"
        if error is None and self.completion_tokens is None:
            error = "no_usage"
        if error is None and self.completion_tokens == 0:
            error = "no_output"
        return Outcome(
            error=error,
            sent_input_len=len(spec.prompt),
            asked_output_len=spec.output_len,
            input_tokens=self.prompt_tokens if self.prompt_tokens is not None else len(spec.prompt),
            output_tokens=self.completion_tokens or 0,
            ttft_s=(self.first - self.sent) if self.first is not None else math.nan,
            itls_s=self.itls,
            e2e_s=ended - self.sent,
            sent_at=self.sent,
            ended_at=ended,
        )


def request_body(target: Target, spec: RequestSpec) -> dict[str, Any]:
    """The completion request: always with ``include_usage`` (the tokens are counted from it)."""
    stream_options: dict[str, Any] = {"include_usage": True}
    if target.continuous_usage_stats:
        stream_options["continuous_usage_stats"] = True
    body: dict[str, Any] = {
        "model": target.model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "temperature": target.temperature,
        "stream": True,
        "stream_options": stream_options,
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **target.extra_body}


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, msgspec.DecodeError):
        return "bad_chunk"
    return type(exc).__name__


async def send_request(client: httpx.AsyncClient, target: Target, spec: RequestSpec) -> Outcome:
    """One streamed completion; every failure becomes an Outcome with its error kind."""
    body = msgspec.json.encode(request_body(target, spec))
    state = StreamState(time.perf_counter())
    try:
        async with client.stream("POST", "/v1/completions", content=body,
                                 headers={"content-type": "application/json"}) as response:
            if response.status_code != 200:
                await response.aread()
                state.error = f"http_{response.status_code}"
            else:
                await read_events(response, state)
    except Exception as exc:  # noqa: BLE001 - any failure is one request's error, never the run's
        state.error = error_kind(exc)
    return state.outcome(spec, time.perf_counter())


async def read_events(response: httpx.Response, state: StreamState) -> None:
    """Feed every ``data:`` line of an SSE stream to ``state``, timed when its bytes arrived."""
    buffer = b""
    async for data in response.aiter_raw():
        now = time.perf_counter()
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event: fields
            payload = line[5:].strip()
            if payload == b"[DONE]" or not payload:
                continue
            state.take(decode_chunk(payload), now)
            if state.error is not None:
                return


class Share(NamedTuple):
    """The requests of a level that one client process sends: at ``offsets`` seconds from the
    level's start, at most ``max_concurrency`` in flight (None: no cap)."""

    specs: list[RequestSpec]
    offsets: list[float]
    max_concurrency: int | None


async def run_share(client: httpx.AsyncClient, target: Target, share: Share, start_at: float) -> list[Outcome]:
    """Send ``share``'s requests, each at ``start_at`` (a perf_counter reading) + its offset, or
    when a slot frees under the cap (its clock starts then); their outcomes in the order they ended."""
    limit = trio.Semaphore(share.max_concurrency) if share.max_concurrency else None
    outcomes: list[Outcome] = []

    async def one(spec: RequestSpec) -> None:
        if limit is None:
            outcomes.append(await send_request(client, target, spec))
            return
        async with limit:
            outcomes.append(await send_request(client, target, spec))

    async with trio.open_nursery() as nursery:
        for spec, offset in zip(share.specs, share.offsets):
            await trio.sleep(max(0.0, start_at + offset - time.perf_counter()))
            nursery.start_soon(one, spec)
    return outcomes
