"""A test double of the ingress: a Backend that "generates" by echoing the prompt.

Token ids are Unicode code points, one character per token, so every expected value in the
tests can be worked out by hand: the completion of "hello" with max_tokens 3 is "hel".
Stop strings and stop token ids are looked for in the prompt, and the text stops before them,
as the detokenizer trims a matched stop string. Knobs make it reject, fail mid-way or go slow,
for every request or for one (``failing_rid``), and cut one request short (``max_tokens_of``),
so that the choices of one prompt (OpenAI's ``n``) can differ.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import AsyncIterator

import trio

from app.http.backend import ModelCard, RequestError, ServerError, ServerState
from app.ipc.messages import (
    ControlKind,
    Finish,
    FinishReason,
    GenerateRequest,
    TextOutput,
    TokenLogprobs,
    Usage,
    pack_tokens,
    unpack_tokens,
)

VOCAB_SIZE = 0x110000  # every code point is a token


class EchoBackend:
    """Echoes the prompt; records what it was asked and what was aborted."""

    model = ModelCard(name="echo", path="/models/echo", context_length=256, vocab_size=VOCAB_SIZE, architecture="Echo")

    def __init__(self) -> None:
        self.state = ServerState.SERVING
        self.cached_tokens = 2  # reported in every usage
        self.delay_s = 0.0  # before each output
        self.reject: RequestError | ServerError | None = None  # raised before the first output
        self.fail_after: int | None = None  # raise ServerError after this many outputs
        self.failing_rid: str | None = None  # when set, reject and fail_after apply to this request only
        self.max_tokens_of: dict[str, int] = {}  # rid → a smaller max_new_tokens than it asked for
        self.abort_status = 499  # of the final output after abort(): 499 is an answer, 503 an error
        self.requests: list[GenerateRequest] = []
        self.started: dict[str, trio.Event] = {}
        self.closed_early: dict[str, trio.Event] = {}  # set when an unfinished request's iterator closes
        self.controls: list[ControlKind] = []
        self._abort_requested: dict[str, trio.Event] = {}
        self._live: set[str] = set()

    @staticmethod
    def prompt_of(request: GenerateRequest) -> str:
        if request.text is not None:
            return request.text
        if request.input_ids is not None:
            return "".join(map(chr, unpack_tokens(request.input_ids)))
        return "".join(m.content for m in request.messages or ())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TextOutput]:
        rid = request.rid
        self.requests.append(request)
        self.started.setdefault(rid, trio.Event()).set()
        self.closed_early[rid] = trio.Event()
        self._abort_requested[rid] = trio.Event()
        failing = self.failing_rid in (None, rid)
        if self.reject is not None and failing:
            raise self.reject
        self._live.add(rid)
        pieces, finish = self._plan(request, self.max_tokens_of.get(rid))
        prompt_tokens, completion_tokens = len(self.prompt_of(request)), 0
        finished = False
        try:
            for i, (text, ids) in enumerate(pieces):
                with trio.move_on_after(self.delay_s):
                    await self._abort_requested[rid].wait()
                if self._abort_requested[rid].is_set():
                    finished = True
                    aborted = Finish(FinishReason.ABORT, message="aborted", status_code=self.abort_status)
                    yield TextOutput(rid, "", b"", aborted)
                    return
                if self.fail_after is not None and i == self.fail_after and failing:
                    raise ServerError("the scheduler died", 500)
                last = i == len(pieces) - 1
                completion_tokens += len(ids)
                usage = Usage(prompt_tokens, completion_tokens, self.cached_tokens)
                finished = last
                yield TextOutput(
                    rid,
                    text,
                    pack_tokens(ids),
                    finish=finish if last else None,
                    usage=usage if last or i == 0 else None,
                    logprobs=self._logprobs(ids, request.sampling.top_logprobs) if request.sampling.logprobs else None,
                    produced_at=time.monotonic(),
                )
        finally:
            self._live.discard(rid)
            if not finished:
                # As the ingress sends its abort: shielded, for a disconnect cancels the reader,
                # and the cancellation lands in here when we are waiting for the next output.
                with trio.CancelScope(shield=True):
                    await trio.sleep(0)
                self.closed_early[rid].set()

    @staticmethod
    def _plan(request: GenerateRequest, limit: int | None) -> tuple[list[tuple[str, list[int]]], Finish]:
        """The outputs (text, token ids) the request gets, and how it finishes."""
        prompt, sampling = EchoBackend.prompt_of(request), request.sampling
        limit = sampling.max_new_tokens if limit is None else min(limit, sampling.max_new_tokens)
        stops = [(prompt.find(s), s) for s in sampling.stop] + [(prompt.find(chr(t)), t) for t in sampling.stop_token_ids]
        hits = sorted((at, stop) for at, stop in stops if at >= 0 and at + len(_text(stop)) <= limit)
        if hits:
            at, stop = hits[0]
            pieces = [(c, [ord(c)]) for c in prompt[:at]] + [("", [ord(c) for c in _text(stop)])]
            return pieces, Finish(FinishReason.STOP, matched=stop)
        pieces = [(c, [ord(c)]) for c in prompt[:limit]] or [("", [])]
        if len(prompt) >= limit:
            return pieces, Finish(FinishReason.LENGTH)
        return pieces, Finish(FinishReason.STOP)  # the end of the prompt stands for EOS

    @staticmethod
    def _logprobs(ids: list[int], k: int) -> TokenLogprobs:
        """Every chosen token has logprob -0.5; alternative j is token id + j with -0.5 - j."""
        top_ids = [t + j for t in ids for j in range(k)]
        top_lps = [-0.5 - j for _ in ids for j in range(k)]
        return TokenLogprobs(
            chosen=array("f", [-0.5] * len(ids)).tobytes(),
            top_ids=pack_tokens(top_ids),
            top_logprobs=array("f", top_lps).tobytes(),
            k=k,
        )

    async def abort(self, rid: str | None) -> bool:
        rids = list(self._live) if rid is None else [rid]
        for r in rids:
            if r in self._live:
                self._abort_requested[r].set()
        return any(r in self._live for r in rids)

    async def control(self, kind: ControlKind) -> bytes:
        self.controls.append(kind)
        return b'{"flushed": true}'

    async def server_info(self) -> dict:
        """The ingress's shape: arguments, the scheduler's figures, requests in flight."""
        return {
            "args": {"model_path": "/models/echo", "api_key": None},
            "scheduler": {"running_requests": 0, "queued_requests": 0, "token_usage": 0.0, "max_total_tokens": 4096,
                          "device": "cpu", "step_timing": {"steps": 0}},
            "requests_in_flight": len(self._live),
        }


def _text(stop: str | int) -> str:
    return stop if isinstance(stop, str) else chr(stop)
