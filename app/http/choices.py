"""Several completions of one prompt (OpenAI's ``n``), or of several prompts (a batched
``prompt``): one request fanned out, its outputs merged.

How a request with ``n`` choices is served::

    fan_out_prompts: P GenerateRequests (one per prompt) ─▶ P × n GenerateRequests
                     (rids <rid>-0 … <rid>-<P n - 1>, prompt p's choice i with seed+i)
    open_choices:
        nursery ─┬─ choice 0:   open_outputs ─▶ forward each output ─┐
                 ├─ …                                                ├─▶ channel ─▶ ChoiceOutputs
                 └─ choice n-1: open_outputs ─▶ forward each output ─┘     (the response reads them)

All choices are submitted at once and run concurrently in the scheduler's batch. Every choice's
first output is received before ``open_choices`` yields, so a rejection of any choice is an
HTTP status, as it is for one. A choice that fails fails the whole request: its error is raised
to the reader, and leaving ``open_choices`` cancels the others, whose closed outputs abort them.

One choice (n = 1, most requests) skips all that: its outputs are read straight from the backend,
one task less and one channel less per output.

The forwarding tasks never raise into their nursery: they send their error down the channel.
The nursery outlives the handler (it lives in the request's resources, beside the stream it
feeds), and a raising task would cancel the response mid-send instead of letting it end the
stream with an error event.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import NamedTuple

import msgspec
import trio

from app.http.backend import Backend, RequestError, ServerError
from app.http.errors import from_backend
from app.http.outputs import Collector, Completed, Outputs, open_outputs, unfinished
from app.ipc.messages import GenerateRequest, TextOutput, Usage

_SEED_LIMIT = 2**63  # SamplingParams.validate's bound: seed + i wraps around below it


class ChoiceOutput(NamedTuple):
    """One output of one choice; ``index`` is the choice's place in ``choices``."""

    index: int
    output: TextOutput


class _Failed(NamedTuple):
    """A choice's error, travelling to the reader instead of into the nursery."""

    index: int
    error: Exception


def fan_out_prompts(requests: Sequence[GenerateRequest], n: int) -> list[GenerateRequest]:
    """The choices of one prompt or of several (OpenAI's batched ``prompt``), ``n`` each: prompt
    p's choice i is choice ``p * n + i``, with rid ``<rid>-<p * n + i>`` (so that the request's own
    id aborts them all). With a seed, choice i samples with seed + i: the choices differ, and the
    same request gives the same choices again; without one, each draws its own random stream.
    One prompt with one choice keeps its request as it is."""
    if len(requests) == 1 and n == 1:
        return [requests[0]]
    choices = []
    for p, request in enumerate(requests):
        seed = request.sampling.seed
        for i in range(n):
            sampling = request.sampling if seed is None else msgspec.structs.replace(
                request.sampling, seed=(seed + i) % _SEED_LIMIT)
            choices.append(msgspec.structs.replace(request, rid=f"{request.rid}-{p * n + i}", sampling=sampling))
    return choices


def merge_usage(usages: Sequence[Usage | None], per_prompt: int | None = None) -> Usage:
    """The usage of a request with several choices, as OpenAI counts it: each prompt once.

    ``usages`` are in choice order, ``per_prompt`` choices a prompt (all of them one prompt when
    None); a choice that has not reported yet is None. A prompt's ``cached_tokens`` is the least
    any of its choices found cached, so that it describes that prompt (never more than its
    ``prompt_tokens``) and not the choices' reuse of each other's prefill.
    """
    per = per_prompt or max(1, len(usages))
    prompt = completion = cached = 0
    for start in range(0, len(usages), per):
        reported = [u for u in usages[start:start + per] if u is not None]
        if reported:
            prompt += reported[0].prompt_tokens
            cached += min(u.cached_tokens for u in reported)
            completion += sum(u.completion_tokens for u in reported)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)


@asynccontextmanager
async def open_choices(
    backend: Backend, requests: Sequence[GenerateRequest]
) -> AsyncIterator[AsyncIterator[ChoiceOutput]]:
    """Submit every choice at once; yields their outputs, merged, with every choice started.

    Raises ApiError when any choice is rejected or fails before its first output (the others
    are aborted). On the way out, every choice still running is aborted.
    """
    if len(requests) == 1:  # one choice: its outputs as they come, without a forwarding task
        async with open_outputs(backend, requests[0]) as outputs:
            yield _One(outputs)
        return
    send, receive = trio.open_memory_channel[ChoiceOutput | _Failed](len(requests))
    error: Exception | None = None
    async with trio.open_nursery() as nursery:
        for index, request in enumerate(requests):
            nursery.start_soon(_forward, backend, index, request, send.clone())
        send.close()
        try:
            yield await _Merged.open(receive, len(requests))
        except Exception as exc:  # raised again below, not wrapped in the nursery's ExceptionGroup
            error = exc
        finally:
            nursery.cancel_scope.cancel()
    receive.close()
    if error is not None:
        raise error


async def _forward(
    backend: Backend, index: int, request: GenerateRequest, send: trio.MemorySendChannel[ChoiceOutput | _Failed]
) -> None:
    """Pass one choice's outputs to the reader; its error too (see the module docstring)."""
    async with send:
        try:
            async with open_outputs(backend, request) as outputs:
                async for output in outputs:
                    await send.send(ChoiceOutput(index, output))
        except Exception as exc:
            await send.send(_Failed(index, exc))


class _One:
    """The outputs of a request with one choice, as ChoiceOutputs of index 0."""

    def __init__(self, outputs: Outputs) -> None:
        self._outputs = outputs

    def __aiter__(self) -> _One:
        return self

    async def __anext__(self) -> ChoiceOutput:
        return ChoiceOutput(0, await anext(self._outputs))

    def next_nowait(self) -> ChoiceOutput:
        """The next output if it is here already; trio.WouldBlock otherwise."""
        return ChoiceOutput(0, self._outputs.next_nowait())


class _Merged:
    """The choices' outputs in the order they come, ending after every choice's final one."""

    def __init__(self, receive: trio.MemoryReceiveChannel[ChoiceOutput | _Failed], n: int) -> None:
        self._receive = receive
        self._unfinished = n  # choices whose final output has not been read yet
        self._early: deque[ChoiceOutput | _Failed] = deque()  # received while opening, not read yet

    @classmethod
    async def open(cls, receive: trio.MemoryReceiveChannel[ChoiceOutput | _Failed], n: int) -> _Merged:
        """Wait for every choice's first output; raise the first failure instead."""
        merged, started = cls(receive, n), set()
        while len(started) < n:
            item = await merged._next_item()
            if isinstance(item, _Failed):
                raise item.error
            started.add(item.index)
            merged._early.append(item)
        return merged

    async def _next_item(self) -> ChoiceOutput | _Failed:
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:  # every task ended: one must have lost its final output
            raise unfinished() from None

    def __aiter__(self) -> _Merged:
        return self

    async def __anext__(self) -> ChoiceOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = self._early.popleft() if self._early else await self._next_item()
        return self._take(item)

    def next_nowait(self) -> ChoiceOutput:
        """The next output if it is here already; trio.WouldBlock otherwise (a failure and the
        end are left for ``__anext__``)."""
        if not self._unfinished:
            raise trio.WouldBlock
        if self._early:
            if isinstance(self._early[0], _Failed):
                raise trio.WouldBlock
            return self._take(self._early.popleft())
        try:
            item = self._receive.receive_nowait()
        except trio.EndOfChannel:
            raise trio.WouldBlock from None  # __anext__ says what that means
        if isinstance(item, _Failed):
            self._early.append(item)
            raise trio.WouldBlock
        return self._take(item)

    def _take(self, item: ChoiceOutput | _Failed) -> ChoiceOutput:
        if isinstance(item, _Failed):
            raise item.error
        if item.output.finish is not None:
            self._unfinished -= 1
        return item


async def collect_choices(choices: AsyncIterator[ChoiceOutput], n: int) -> list[Completed]:
    """Gather every choice (non-streaming answers), by index; ApiError when any failed."""
    collectors = [Collector() for _ in range(n)]
    done: list[Completed | None] = [None] * n
    try:
        async for index, output in choices:
            completed = collectors[index].add(output)
            if completed is not None:
                done[index] = completed
    except (RequestError, ServerError) as exc:
        raise from_backend(exc) from exc
    if any(d is None for d in done):
        raise from_backend(unfinished())
    return [d for d in done if d is not None]
