"""A test double of the ingress: a Backend that "generates" by echoing the prompt.

Token ids are Unicode code points, one character per token, so every expected value in the
tests can be worked out by hand: the completion of "hello" with max_tokens 3 is "hel".
Stop strings and stop token ids are looked for in the prompt, and the text stops before them,
as the detokenizer trims a matched stop string. Knobs make it reject, fail mid-way or go slow,
for every request or for one (``failing_rid``), and cut one request short (``max_tokens_of``),
so that the choices of one prompt (OpenAI's ``n``) can differ.

Like the ingress, it answers every submitted request from a task of its own (in the nursery
``run`` opens), into the channel the request was submitted with.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterator
from typing import Any, NamedTuple

import trio

from app.http.backend import Answer, Failure, ModelCard, RequestError, ServerError, ServerState
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


class _Pause(NamedTuple):
    """A wait before the next answer, cut short by an abort."""

    seconds: float


class EchoBackend:
    """Echoes the prompt; records what it was asked and what was aborted. ``run`` must be
    started (``await nursery.start(backend.run)``) before requests are submitted."""

    model = ModelCard(name="echo", path="/models/echo", context_length=256, vocab_size=VOCAB_SIZE, architecture="Echo")

    def __init__(self) -> None:
        self.state = ServerState.SERVING
        self.cached_tokens = 2  # reported in every usage
        self.delay_s = 0.0  # before each output
        self.reject: RequestError | ServerError | None = None  # the answer instead of the first output
        self.fail_after: int | None = None  # fail with a ServerError after this many outputs
        self.failing_rid: str | None = None  # when set, reject and fail_after apply to this request only
        self.max_tokens_of: dict[str, int] = {}  # rid → a smaller max_new_tokens than it asked for
        self.abort_status = 499  # of the final output after abort(): 499 is an answer, 503 an error
        self.requests: list[GenerateRequest] = []
        self.started: dict[str, trio.Event] = {}
        self.closed_early: dict[str, trio.Event] = {}  # set when an unfinished request is released
        self.answered: dict[str, trio.Event] = {}  # set once a request's last answer is in its channel
        self.controls: list[ControlKind] = []
        self._nursery: trio.Nursery | None = None  # run's: every request's task lives in it
        self._abort_requested: dict[str, trio.Event] = {}
        self._live: dict[str, trio.CancelScope] = {}  # submitted, not released: the scope of its task
        self._finished: set[str] = set()  # live requests whose last answer has been sent

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Answer requests until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    @staticmethod
    def prompt_of(request: GenerateRequest) -> str:
        if request.text is not None:
            return request.text
        if request.input_ids is not None:
            return "".join(map(chr, unpack_tokens(request.input_ids)))
        return "".join(m.content for m in request.messages or ())

    async def submit(self, request: GenerateRequest, answers: trio.MemorySendChannel[Answer]) -> None:
        rid = request.rid
        if self._nursery is None:
            raise RuntimeError("EchoBackend.run has not been started")
        if rid in self._live:
            raise RequestError(f"duplicate request id {rid!r}", 400, "rid")
        self.requests.append(request)
        self.started.setdefault(rid, trio.Event()).set()
        self.closed_early[rid] = trio.Event()
        self.answered[rid] = trio.Event()
        self._abort_requested[rid] = trio.Event()
        self._live[rid] = scope = trio.CancelScope()
        self._nursery.start_soon(self._answer, request, answers, scope)
        await trio.lowlevel.checkpoint()

    async def release(self, rid: str) -> None:
        scope = self._live.pop(rid, None)
        if scope is None:
            return
        scope.cancel()
        if rid not in self._finished:
            # As the ingress sends its abort: shielded, for a disconnect cancels the reader.
            with trio.CancelScope(shield=True):
                await trio.sleep(0)
            self.closed_early[rid].set()
        self._finished.discard(rid)

    async def _answer(self, request: GenerateRequest, answers: trio.MemorySendChannel[Answer],
                      scope: trio.CancelScope) -> None:
        """Send the request's answers, then close its channel (also when released early)."""
        rid = request.rid
        with scope, answers:
            for answer in self._answers(request):
                if isinstance(answer, _Pause):
                    with trio.move_on_after(answer.seconds):
                        await self._abort_requested[rid].wait()
                    continue
                last = isinstance(answer, Failure) or answer.finish is not None
                if last:
                    self._finished.add(rid)
                answers.send_nowait(answer)
                if last:
                    self.answered[rid].set()
                    return

    def _answers(self, request: GenerateRequest) -> Iterator[Answer | _Pause]:
        """What the request gets, in order, with the pauses between."""
        rid = request.rid
        failing = self.failing_rid in (None, rid)
        if self.reject is not None and failing:
            yield Failure(rid, self.reject)
            return
        pieces, finish = self._plan(request, self.max_tokens_of.get(rid))
        prompt_tokens, completion_tokens = len(self.prompt_of(request)), 0
        for i, (text, ids) in enumerate(pieces):
            yield _Pause(self.delay_s)
            if self._abort_requested[rid].is_set():
                aborted = Finish(FinishReason.ABORT, message="aborted", status_code=self.abort_status)
                yield TextOutput(rid, "", b"", aborted)
                return
            if self.fail_after is not None and i == self.fail_after and failing:
                yield Failure(rid, ServerError("the scheduler died", 500))
                return
            last = i == len(pieces) - 1
            completion_tokens += len(ids)
            usage = Usage(prompt_tokens, completion_tokens, self.cached_tokens)
            yield TextOutput(
                rid,
                text,
                pack_tokens(ids),
                finish=finish if last else None,
                usage=usage if last or i == 0 else None,
                logprobs=self._logprobs(ids, request.sampling.top_logprobs) if request.sampling.logprobs else None,
                produced_at=time.monotonic(),
            )

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
        running = [r for r in rids if r in self._live and r not in self._finished]
        for r in running:
            self._abort_requested[r].set()
        return bool(running)

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
