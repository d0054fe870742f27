"""Reading a request's TextOutputs, whatever the API: pulling, closing, collecting, unpacking.

Every route consumes ``Backend.generate`` the same way: the first output is awaited before the
response starts (so a rejection or an early failure is an HTTP status, not an SSE event), the
iterator is always closed (closing it is what aborts the request on the backend side), and a
final ``Finish`` of ABORT that carries an error status becomes an ``ApiError``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import NamedTuple

import structlog
import trio

from app.http.backend import Backend, RequestError, ServerError
from app.http.errors import ApiError, from_backend
from app.ipc.messages import (  # noqa: F401 - TokenLogprob and unpack_logprobs are re-exported
    Finish,
    FinishReason,
    GenerateRequest,
    TextOutput,
    TokenLogprob,
    Usage,
    unpack_logprobs,
    unpack_tokens,
)

# An ABORT finish with one of these statuses (or none) is an answer, not an error: the client
# (or an operator, through /abort_request) asked for it, and gets finish_reason "abort".
_ANSWERED_ABORT_STATUSES = (None, 499)

_log = structlog.get_logger("app.http.outputs")


class Completed(NamedTuple):
    """A whole request's output, collected for a non-streaming answer."""

    text: str
    token_ids: list[int]
    finish: Finish
    usage: Usage
    logprobs: list[TokenLogprob]


def check_finish(finish: Finish | None) -> None:
    """Raise the ApiError a final output stands for, if it is an abort with an error status."""
    if finish is None or finish.reason is not FinishReason.ABORT:
        return
    if finish.status_code not in _ANSWERED_ABORT_STATUSES:
        raise ApiError(finish.status_code, finish.message or "The request was aborted.")


class Tally:
    """What a request has produced so far: its token count and the latest usage reported."""

    def __init__(self) -> None:
        self.completion_tokens = 0
        self._usage: Usage | None = None

    def add(self, output: TextOutput) -> list[int]:
        """Count ``output``; returns its token ids."""
        ids = unpack_tokens(output.token_ids)
        self.completion_tokens += len(ids)
        if output.usage is not None:
            self._usage = output.usage
        return ids

    @property
    def usage(self) -> Usage:
        """The backend's usage; counted tokens where it sent none (it should, on the final output)."""
        if self._usage is None:
            return Usage(prompt_tokens=0, completion_tokens=self.completion_tokens)
        return self._usage

    @property
    def reported(self) -> bool:
        """Whether the backend has sent a usage yet (ours does with the first output and the final one)."""
        return self._usage is not None


def unfinished() -> ServerError:
    """What a request that ended without its final output is answered with."""
    return ServerError("The request ended without a final answer.", 500)


# Closing the backend's iterator sends the abort; it gets this long even when the request's
# scope is already cancelled (the client left), so that a disconnect always frees the request.
# This covers an iterator suspended at its ``yield``; a cancellation that lands while it awaits
# its next output is raised inside it, and its own clean-up must shield the abort.
_CLOSE_GRACE_S = 5.0


@asynccontextmanager
async def open_outputs(backend: Backend, request: GenerateRequest) -> AsyncIterator[AsyncIterator[TextOutput]]:
    """Submit ``request``; yields its outputs with the first already received, and closes the
    backend's iterator on the way out (which aborts the request when it has not finished).

    Raises ApiError for a rejection or a failure that happens before the first output.
    """
    outputs = backend.generate(request)
    try:
        try:
            first = await anext(outputs)
        except StopAsyncIteration:
            raise from_backend(unfinished()) from None
        except (RequestError, ServerError) as exc:
            raise from_backend(exc) from exc
        check_finish(first.finish)
        yield Outputs(first, outputs)
    finally:
        await _close(outputs, request.rid)


async def _close(outputs: AsyncIterator[TextOutput], rid: str) -> None:
    """Close the backend's iterator, shielded for a while: its clean-up sends the abort."""
    aclose = getattr(outputs, "aclose", None)
    if aclose is None:
        return
    with trio.CancelScope(deadline=trio.current_time() + _CLOSE_GRACE_S, shield=True):
        try:
            await aclose()
        except Exception:  # the answer is out already; a failed clean-up is the backend's bug
            _log.exception("closing a request's outputs failed", rid=rid)


class Outputs:
    """``first`` then the rest, ending after the final output; ServerError if none comes."""

    def __init__(self, first: TextOutput, rest: AsyncIterator[TextOutput]) -> None:
        self._first: TextOutput | None = first
        self._rest = rest
        self._done = False

    def __aiter__(self) -> Outputs:
        return self

    async def __anext__(self) -> TextOutput:
        if self._done:
            raise StopAsyncIteration
        if self._first is not None:
            output, self._first = self._first, None
        else:
            try:
                output = await anext(self._rest)
            except StopAsyncIteration:
                raise unfinished() from None
        self._done = output.finish is not None
        return output

    def next_nowait(self) -> TextOutput:
        """The next output if it is here already (see ``Backend.generate``); trio.WouldBlock
        otherwise, and always after the final one or when the backend cannot tell."""
        if self._done:
            raise trio.WouldBlock
        if self._first is not None:
            output, self._first = self._first, None
        else:
            take = getattr(self._rest, "next_nowait", None)
            if take is None:
                raise trio.WouldBlock
            output = take()
        self._done = output.finish is not None
        return output


class Collector:
    """Gathers one request's outputs into a Completed (non-streaming answers, one per choice)."""

    def __init__(self) -> None:
        self._tally = Tally()
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []

    def add(self, output: TextOutput) -> Completed | None:
        """Take one output; the whole request once it is final. ApiError for a failed request."""
        ids = self._tally.add(output)
        self._texts.append(output.text)
        self._token_ids.extend(ids)
        self._logprobs.extend(unpack_logprobs(ids, output.logprobs))
        if output.finish is None:
            return None
        check_finish(output.finish)
        return Completed("".join(self._texts), self._token_ids, output.finish, self._tally.usage, self._logprobs)


async def collect(outputs: AsyncIterator[TextOutput]) -> Completed:
    """Gather a whole request (non-streaming answers); raises ApiError for a failed one."""
    collector = Collector()
    try:
        async for output in outputs:
            done = collector.add(output)
            if done is not None:
                return done
    except (RequestError, ServerError) as exc:
        raise from_backend(exc) from exc
    raise from_backend(unfinished())
