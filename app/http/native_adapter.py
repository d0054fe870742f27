"""SGLang's native POST /generate on our protocol: body → GenerateRequest, outputs → responses.

Streaming follows SGLang: every event carries the whole text (and output ids) so far, and the
last one has ``meta_info.finish_reason`` set. ``meta_info.produced_at`` is the server host's
time.monotonic() when the event's newest tokens were produced (CLOCK_MONOTONIC is system-wide on
Linux, so a client on the same host can subtract it from its own time.monotonic() on receipt).
"""

from __future__ import annotations

import time

import msgspec
from msgspec import UNSET

from app.http.errors import ApiError
from app.http.outputs import Tally, TokenLogprob, check_finish, unpack_logprobs
from app.http.request_stream import ChoiceOutput
from app.http.sampling import bias_pairs, make_sampling, stop_strings
from app.http.schemas import GenerateBody, GenerateResponse, MetaInfo, NativeFinishReason, NativeLogprob
from app.ipc.messages import (
    Finish,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TextOutput,
    Usage,
    first_outside_vocab,
    pack_tokens,
)


def generate_request(
    body: GenerateBody, rid: str, vocab_size: int, defaults: SamplingParams, arrival: float, *, priority: int = 0
) -> GenerateRequest:
    """The GenerateRequest for POST /generate (``priority``: the body's, resolved by the routes'
    settings); ApiError 400 for what we cannot serve."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError.bad_request("Give exactly one of `text` and `input_ids`.", "text")
    if body.input_ids is not None:  # not empty: the schema says so
        bad = first_outside_vocab(body.input_ids, vocab_size)
        if bad is not None:
            raise ApiError.bad_request(f"input_ids holds {bad}, outside the vocabulary [0, {vocab_size}).", "input_ids")
    sp = body.sampling_params
    given = {
        "max_new_tokens": sp.max_new_tokens,
        "max_new_tokens_given": sp.max_new_tokens is not None,
        "min_new_tokens": sp.min_new_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "min_p": sp.min_p,
        "frequency_penalty": sp.frequency_penalty,
        "presence_penalty": sp.presence_penalty,
        "repetition_penalty": sp.repetition_penalty,
        "stop": stop_strings(sp.stop),
        "stop_token_ids": None if sp.stop_token_ids is None else tuple(sp.stop_token_ids),
        "ignore_eos": sp.ignore_eos,
        "skip_special_tokens": sp.skip_special_tokens,
        "seed": sp.sampling_seed,
        "logit_bias": bias_pairs(sp.logit_bias),
        "waiting_timeout": sp.waiting_timeout if sp.waiting_timeout is not None else body.waiting_timeout,
        "timeout": sp.timeout if sp.timeout is not None else body.timeout,
        "logprobs": body.return_logprob,
        "top_logprobs": body.top_logprobs_num if body.return_logprob else 0,
    }
    names = {field: f"sampling_params.{field}" for field in given} | {
        "seed": "sampling_params.sampling_seed",
        "top_logprobs": "top_logprobs_num",
    }
    sampling = make_sampling(defaults, given, client_names=names, vocab_size=vocab_size)
    return GenerateRequest(
        rid=rid,
        sampling=sampling,
        stream=body.stream,
        text=body.text,
        input_ids=None if body.input_ids is None else pack_tokens(body.input_ids),
        priority=priority,
        arrival_time=arrival,
        prompt_field="text" if body.text is not None else "input_ids",
        max_tokens_field="sampling_params.max_new_tokens",
    )


def finish_reason(finish: Finish, completion_tokens: int) -> NativeFinishReason:
    if finish.reason is FinishReason.STOP:
        return NativeFinishReason(type="stop", matched=finish.matched)
    if finish.reason is FinishReason.LENGTH:
        return NativeFinishReason(type="length", length=completion_tokens)
    return NativeFinishReason(type="abort", message=finish.message)


class NativeAnswer:
    """Accumulates one request's outputs into SGLang's response: cumulative text and ids."""

    def __init__(self, rid: str, arrival: float, want_logprobs: bool) -> None:
        self._rid = rid
        self._arrival = arrival
        self._want_logprobs = want_logprobs
        self._tally = Tally()
        self._text = ""
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self.last: GenerateResponse | None = None  # the response as it stands after the latest output

    def add(self, output: TextOutput) -> GenerateResponse:
        """Take one output; the response as it stands after it. ApiError for a failed request."""
        ids = self._tally.add(output)
        check_finish(output.finish)
        self._text += output.text
        self._ids.extend(ids)
        if self._want_logprobs:
            self._logprobs.extend(unpack_logprobs(ids, output.logprobs))
        self.last = self._response(output.finish, self._tally.usage, output.produced_at or None)
        return self.last

    def _response(self, finish: Finish | None, usage: Usage, produced_at: float | None) -> GenerateResponse:
        completion_tokens = len(self._ids)
        meta = MetaInfo(
            id=self._rid,
            finish_reason=None if finish is None else finish_reason(finish, completion_tokens),
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=completion_tokens if finish is None else usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            e2e_latency=round(time.time() - self._arrival, 6),
            produced_at=produced_at,
            output_token_logprobs=self._token_logprobs() if self._want_logprobs else UNSET,
            output_top_logprobs=self._top_logprobs() if self._want_logprobs else UNSET,
        )
        return GenerateResponse(text=self._text, output_ids=list(self._ids), meta_info=meta)

    def _token_logprobs(self) -> list[NativeLogprob]:
        return [(lp.logprob, lp.token_id, None) for lp in self._logprobs]

    def _top_logprobs(self) -> list[list[NativeLogprob]]:
        return [[(v, t, None) for t, v in lp.top] for lp in self._logprobs]


class NativeResponses:
    """A /generate request's answer, from its stream's outputs: one response, or with
    ``sampling_params.n`` > 1 one per choice, tagged with ``index`` (choice i answers as request
    ``<rid>-i``, how the choices are submitted)."""

    def __init__(self, rid: str, n: int, arrival: float, want_logprobs: bool) -> None:
        rids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        self._answers = [NativeAnswer(r, arrival, want_logprobs) for r in rids]
        self._several = n > 1

    def add(self, item: ChoiceOutput) -> None:
        """Take one output of choice ``item.index``; ApiError for a failed choice."""
        self._answers[item.index].add(item.output)

    def events(self, item: ChoiceOutput) -> list[GenerateResponse]:
        """For EventStream: the choice's response so far, after each output that adds text or
        finishes it."""
        index, output = item
        response = self._answers[index].add(output)
        if not output.text and output.finish is None:
            return []
        return [msgspec.structs.replace(response, index=index) if self._several else response]

    def result(self) -> GenerateResponse | list[GenerateResponse]:
        """The whole answer, after every choice's final output: a list, by index, for n > 1."""
        last = [answer.last for answer in self._answers]
        if any(r is None or r.meta_info.finish_reason is None for r in last):
            raise ApiError(500, "A choice ended without a final answer.")
        responses = [r for r in last if r is not None]
        if not self._several:
            return responses[0]
        return [msgspec.structs.replace(r, index=i) for i, r in enumerate(responses)]
