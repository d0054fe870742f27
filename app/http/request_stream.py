"""One client request, as every route serves it: submitted, read, merged and released.

A request with ``n`` choices (OpenAI's ``n``, SGLang's ``sampling_params.n``), or with a batch of
P prompts (OpenAI's list ``prompt``), runs as P × n requests of its own, whose answers come back
merged on one channel::

    RequestStream(backend, requests, n)
      fan out    prompt p's choice i is choice p * n + i: rid <rid>-<p n + i>, seed + i
      open       backend.submit(choice, a clone of one answers channel), for every choice;
                 then read until every choice has answered once (a rejection: an HTTP status)
      iterate    ChoiceOutputs in the order they arrive, ending after every choice's final one;
                 next_nowait takes those already here without waiting (an SSE response that
                 fell behind writes them in one piece)
      close      backend.release(every choice): the backend aborts those not finished

A choice that fails fails the whole request: its error is raised to the reader as an ApiError,
and closing the stream aborts the others. The stream has no task of its own: the backend
delivers into the channel and the reader takes from it, so one choice (most requests) costs
one channel and nothing else.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import NamedTuple

import msgspec
import structlog
import trio

from app.http.backend import Answer, Backend, Failure, RequestError, ServerError
from app.http.errors import ApiError, from_backend
from app.http.outputs import Tally, check_finish
from app.ipc.messages import Finish, GenerateRequest, TextOutput, TokenLogprob, Usage, unpack_logprobs

_SEED_LIMIT = 2**63  # SamplingParams.validate's bound: seed + i wraps around below it

# Releasing the choices sends the aborts; it gets this long even when the request's scope is
# already cancelled (the client left), so that a disconnect always frees the request.
_RELEASE_GRACE_S = 5.0

_log = structlog.get_logger("app.http.request_stream")


class ChoiceOutput(NamedTuple):
    """One output of one choice; ``index`` is the choice's place in ``choices``."""

    index: int
    output: TextOutput


class Completed(NamedTuple):
    """One choice's whole output, collected for a non-streaming answer."""

    text: str
    token_ids: list[int]
    finish: Finish
    usage: Usage
    logprobs: list[TokenLogprob]


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


def unfinished() -> ApiError:
    """What a request whose answers ended without a final output is answered with."""
    return from_backend(ServerError("The request ended without a final answer.", 500))


class RequestStream:
    """The merged outputs of one request's choices (see the module docstring).

    Use it as an async context manager: entering submits every choice and waits for each one's
    first answer (ApiError for a rejection or a failure, with every choice released); leaving
    releases them all. Iterating raises ApiError for a choice that failed, or whose final
    output is an abort with an error status.
    """

    def __init__(self, backend: Backend, requests: Sequence[GenerateRequest], n: int = 1) -> None:
        self._backend = backend
        self._choices = fan_out_prompts(requests, n)
        self._index_of = {choice.rid: index for index, choice in enumerate(self._choices)}
        self._send, self._receive = trio.open_memory_channel[Answer](math.inf)
        self._submitted: list[str] = []  # rids the backend accepted: each is released on close
        self._early: deque[Answer] = deque()  # read while opening (or a failure held back), not taken yet
        self._unfinished = len(self._choices)  # choices whose final output has not been taken
        self._closed = False

    @property
    def choices(self) -> int:
        """How many choices the request has (prompts × n)."""
        return len(self._choices)

    async def __aenter__(self) -> RequestStream:
        try:
            await self._submit_all()
            await self._wait_started()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        await self.aclose()

    async def _submit_all(self) -> None:
        """Every choice at once: they run concurrently in the scheduler's batch."""
        with self._send:  # the backend holds a clone per choice; the channel ends when all are closed
            for choice in self._choices:
                answers = self._send.clone()
                try:
                    await self._backend.submit(choice, answers)
                except (RequestError, ServerError) as exc:
                    answers.close()  # refused: the clone is still ours
                    raise from_backend(exc) from exc
                except BaseException:
                    answers.close()
                    raise
                self._submitted.append(choice.rid)

    async def _wait_started(self) -> None:
        """Read until every choice has answered once; raise the first failure instead."""
        started: set[int] = set()
        while len(started) < len(self._choices):
            answer = await self._receive_answer()
            if isinstance(answer, Failure):
                raise from_backend(answer.error)
            index = self._index_of[answer.rid]
            if index not in started:
                started.add(index)
                check_finish(answer.finish)
            self._early.append(answer)

    async def _receive_answer(self) -> Answer:
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:  # the backend let go of every choice: one lost its final output
            raise unfinished() from None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> ChoiceOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        answer = self._early.popleft() if self._early else await self._receive_answer()
        return self._take(answer)

    def next_nowait(self) -> ChoiceOutput:
        """The next output if it has arrived already; trio.WouldBlock otherwise. A failure and
        the end are left for ``__anext__``, which raises them."""
        if not self._unfinished:
            raise trio.WouldBlock
        if self._early:
            if isinstance(self._early[0], Failure):
                raise trio.WouldBlock
            return self._take(self._early.popleft())
        try:
            answer = self._receive.receive_nowait()
        except trio.EndOfChannel:
            raise trio.WouldBlock from None  # __anext__ says what that means
        if isinstance(answer, Failure):
            self._early.append(answer)
            raise trio.WouldBlock
        return self._take(answer)

    def _take(self, answer: Answer) -> ChoiceOutput:
        if isinstance(answer, Failure):
            raise from_backend(answer.error)
        if answer.finish is not None:
            self._unfinished -= 1
        return ChoiceOutput(self._index_of[answer.rid], answer)

    async def collect(self) -> list[Completed]:
        """Every choice's whole output, by index (non-streaming answers); ApiError when any
        choice failed."""
        collectors = [_Collector() for _ in self._choices]
        done: list[Completed | None] = [None] * len(self._choices)
        async for index, output in self:
            done[index] = collectors[index].add(output)
        completed = [d for d in done if d is not None]
        if len(completed) < len(done):
            raise unfinished()
        return completed

    async def aclose(self) -> None:
        """Release every choice (the backend aborts those not finished), shielded for a while: a
        client that left has cancelled the request's scope, and its aborts must still go out."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(deadline=trio.current_time() + _RELEASE_GRACE_S, shield=True):
            for rid in self._submitted:
                try:
                    await self._backend.release(rid)
                except Exception:  # the answer is out already; a failed release is the backend's bug
                    _log.exception("releasing a request failed", rid=rid)
        self._receive.close()


class _Collector:
    """Gathers one choice's outputs into a Completed."""

    def __init__(self) -> None:
        self._tally = Tally()
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []

    def add(self, output: TextOutput) -> Completed | None:
        """Take one output; the whole choice once it is final. ApiError for a failed choice."""
        ids = self._tally.add(output)
        self._texts.append(output.text)
        self._token_ids.extend(ids)
        self._logprobs.extend(unpack_logprobs(ids, output.logprobs))
        if output.finish is None:
            return None
        check_finish(output.finish)
        return Completed("".join(self._texts), self._token_ids, output.finish, self._tally.usage, self._logprobs)
