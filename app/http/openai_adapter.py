"""OpenAI's API on our protocol: request bodies → GenerateRequest, TextOutputs → responses and chunks.

Pure functions and small per-stream objects; no I/O. Things OpenAI's API has that we do not
support yet are refused with a 400 naming the field, never silently ignored.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from enum import Enum
from typing import NamedTuple

from msgspec import UNSET, UnsetType

from app.http.backend import ModelCard
from app.http.errors import ApiError
from app.http.outputs import Tally, TokenLogprob, check_finish, merge_usage, unpack_logprobs
from app.http.request_stream import ChoiceOutput, Completed
from app.http.sampling import bias_pairs, make_sampling, stop_strings
from app.http.schemas import (
    MAX_PROMPTS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageIn,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    OpenAISampling,
    PromptInput,
    PromptTokensDetails,
    StreamOptions,
    TopLogprob,
    UsageInfo,
)
from app.ipc.messages import (
    ChatMessage,
    Finish,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TextOutput,
    Usage,
    first_outside_vocab,
    pack_tokens,
)

TokenNamer = Callable[[int], str]


def token_id_name(token_id: int) -> str:
    """How a token is named in logprobs until the backend can name it (vLLM's convention)."""
    return f"token_id:{token_id}"


class ResponseMeta(NamedTuple):
    """What every response and chunk of one request repeats."""

    id: str  # cmpl-… / chatcmpl-…
    created: int  # unix seconds
    model: str


# ---------------------------------------------------------------- requests


def check_model(requested: str | None, card: ModelCard) -> None:
    """404 model_not_found, as OpenAI answers, for a model we do not serve."""
    if requested is not None and requested != card.name:
        raise ApiError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")


def _refuse_unsupported(unsupported: dict[str, bool]) -> None:
    for name, present in unsupported.items():
        if present:
            raise ApiError.bad_request(f"`{name}` is not supported yet.", param=name)


def _common_checks(body: OpenAISampling, card: ModelCard) -> None:
    check_model(body.model, card)


def _common_sampling(body: OpenAISampling) -> dict[str, object]:
    """The fields OpenAI's two APIs share, under SamplingParams's names (None: not sent)."""
    return {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "seed": body.seed,
        "stop": stop_strings(body.stop),
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "min_new_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos,
        "stop_token_ids": None if body.stop_token_ids is None else tuple(body.stop_token_ids),
        "skip_special_tokens": body.skip_special_tokens,
        "logit_bias": bias_pairs(body.logit_bias),
        "waiting_timeout": body.waiting_timeout,
        "timeout": body.timeout,
    }


def _int32s(values: list[str | int | list[int]]) -> array | None:
    """``values`` as int32s when every one is an int that fits (one pass in C), else None."""
    try:
        return array("i", values)  # type: ignore[arg-type]
    except (TypeError, OverflowError):
        return None


def _one_prompt(prompt: str | list[int], vocab_size: int, name: str,
                packed: array | None = None) -> tuple[str | None, bytes | None]:
    """(text, packed ids) of one prompt, a string or token ids (``packed``: already as int32s);
    ApiError 400 naming ``name``. The schema has refused empty prompts already."""
    if isinstance(prompt, str):
        return prompt, None
    packed = packed if packed is not None else _int32s(prompt)  # type: ignore[arg-type]
    if packed is None and not all(isinstance(t, int) for t in prompt):
        raise ApiError.bad_request(f"{name} must be a string or a list of token ids.", name)
    bad = first_outside_vocab(prompt, vocab_size)
    if bad is not None:
        raise ApiError.bad_request(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size}).", name)
    return None, pack_tokens(packed if packed is not None else prompt)


def _prompts(prompt: PromptInput, vocab_size: int) -> list[tuple[str | None, bytes | None]]:
    """(text, packed ids) of each prompt in OpenAI's ``prompt``: a string, token ids, or a list of
    either (a batch, at most MAX_PROMPTS); exactly one of each pair is set."""
    if isinstance(prompt, str):
        return [_one_prompt(prompt, vocab_size, "prompt")]
    packed = _int32s(prompt)  # token ids (the common case: one pass in C)
    if packed is not None or all(isinstance(p, int) for p in prompt):
        return [_one_prompt(prompt, vocab_size, "prompt", packed)]  # type: ignore[arg-type]
    if not all(isinstance(p, (str, list)) for p in prompt):
        message = "prompt must be a string, a list of token ids, or a list of either."
        raise ApiError.bad_request(message, "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise ApiError.bad_request(f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} a request.", "prompt")
    if len(prompt) == 1:
        return [_one_prompt(prompt[0], vocab_size, "prompt")]  # type: ignore[arg-type]
    return [_one_prompt(p, vocab_size, f"prompt[{i}]") for i, p in enumerate(prompt)]  # type: ignore[arg-type]


def completion_requests(
    body: CompletionRequest, rid: str, card: ModelCard, defaults: SamplingParams, arrival: float, *, priority: int = 0
) -> list[GenerateRequest]:
    """The GenerateRequests of POST /v1/completions, one per prompt (all ``rid``: the choices get
    their own ids when they fan out); ApiError 4xx for what we cannot serve."""
    _common_checks(body, card)
    _refuse_unsupported({"echo": body.echo, "suffix": bool(body.suffix), "best_of": (body.best_of or 1) > 1})
    prompts = _prompts(body.prompt, card.vocab_size)
    given = _common_sampling(body) | {
        "max_new_tokens": card.context_length if body.max_tokens is None else body.max_tokens,
        "max_new_tokens_given": body.max_tokens is not None,
        "logprobs": body.logprobs is not None,
        "top_logprobs": body.logprobs,
    }
    names = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs": "logprobs"}
    sampling = make_sampling(defaults, given, client_names=names, vocab_size=card.vocab_size)
    return [
        GenerateRequest(rid=rid, sampling=sampling, stream=body.stream, text=text, input_ids=ids, arrival_time=arrival,
                        priority=priority, prompt_field="prompt" if len(prompts) == 1 else f"prompt[{i}]",
                        max_tokens_field="max_tokens")
        for i, (text, ids) in enumerate(prompts)
    ]


def _message_text(message: ChatMessageIn, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for j, part in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if part.type != "text":
            raise ApiError.bad_request(f"{where}: only text content parts are supported yet.", f"{where}.type")
        if part.text is None:
            raise ApiError.bad_request(f"{where}.text must be a string.", f"{where}.text")
        texts.append(part.text)
    return "\n".join(texts)


def chat_request(
    body: ChatCompletionRequest, rid: str, card: ModelCard, defaults: SamplingParams, arrival: float, *,
    priority: int = 0
) -> GenerateRequest:
    """The GenerateRequest for POST /v1/chat/completions; ApiError 4xx for what we cannot serve."""
    _common_checks(body, card)
    _refuse_unsupported(
        {
            "tools": bool(body.tools),
            "tool_choice": body.tool_choice not in (None, "none", "auto"),
            "functions": bool(body.functions),
        }
    )
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError.bad_request("top_logprobs needs logprobs to be true.", "top_logprobs")
    max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    given = _common_sampling(body) | {
        "max_new_tokens": card.context_length if max_tokens is None else max_tokens,
        "max_new_tokens_given": max_tokens is not None,
        "logprobs": body.logprobs,
        "top_logprobs": body.top_logprobs,
    }
    names = {"max_new_tokens": max_name, "min_new_tokens": "min_tokens"}
    sampling = make_sampling(defaults, given, client_names=names, vocab_size=card.vocab_size)
    messages = tuple(ChatMessage(m.role, _message_text(m, i)) for i, m in enumerate(body.messages))
    return GenerateRequest(
        rid=rid,
        sampling=sampling,
        stream=body.stream,
        messages=messages,
        add_generation_prompt=body.add_generation_prompt,
        priority=priority,
        arrival_time=arrival,
        prompt_field="messages",
        max_tokens_field=max_name,
    )


# ---------------------------------------------------------------- responses


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


def _matched(finish: Finish | None) -> int | str | None:
    return finish.matched if finish is not None and finish.reason is FinishReason.STOP else None


def _reason(finish: Finish | None) -> str | None:
    return None if finish is None else finish.reason.value


def completion_logprobs(logprobs: list[TokenLogprob], name: TokenNamer, offset: int) -> CompletionLogprobs:
    """The legacy completions shape; ``offset`` is where these tokens start in the whole text."""
    tokens = [name(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[lp.logprob for lp in logprobs],
        top_logprobs=[{name(t): v for t, v in lp.top} for lp in logprobs],
        text_offset=offsets,
    )


def _top(token_id: int, logprob: float, name: TokenNamer) -> TopLogprob:
    token = name(token_id)
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def chat_logprobs(logprobs: list[TokenLogprob], name: TokenNamer) -> ChatLogprobs:
    content = []
    for lp in logprobs:
        chosen = _top(lp.token_id, lp.logprob, name)
        top = [_top(t, v, name) for t, v in lp.top]
        content.append(
            ChatTokenLogprob(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes, top_logprobs=top)
        )
    return ChatLogprobs(content=content)


def completion_response(
    done: list[Completed], meta: ResponseMeta, want_logprobs: bool, name: TokenNamer, per_prompt: int | None = None
) -> CompletionResponse:
    """The whole answer; ``done`` holds the choices in index order, ``per_prompt`` of each prompt
    (all of them of one prompt when None)."""
    choices = [
        CompletionChoice(
            index=index,
            text=choice.text,
            logprobs=completion_logprobs(choice.logprobs, name, 0) if want_logprobs else None,
            finish_reason=_reason(choice.finish),
            matched_stop=_matched(choice.finish),
        )
        for index, choice in enumerate(done)
    ]
    usage = usage_info(merge_usage([choice.usage for choice in done], per_prompt))
    return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=usage)


def chat_response(
    done: list[Completed], meta: ResponseMeta, want_logprobs: bool, name: TokenNamer
) -> ChatCompletionResponse:
    """The whole answer; ``done`` holds the choices in index order."""
    choices = [
        ChatChoice(
            index=index,
            message=AssistantMessage(content=choice.text),
            logprobs=chat_logprobs(choice.logprobs, name) if want_logprobs else None,
            finish_reason=_reason(choice.finish),
            matched_stop=_matched(choice.finish),
        )
        for index, choice in enumerate(done)
    ]
    usage = usage_info(merge_usage([choice.usage for choice in done]))
    return ChatCompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=usage)


# ---------------------------------------------------------------- streams


class UsageReport(Enum):
    """How a stream reports usage, as ``stream_options`` asks."""

    NONE = "none"  # no ``usage`` field in any chunk
    FINAL = "final"  # include_usage: ``usage: null`` in every chunk, then one with the request's usage
    # and continuous_usage_stats (vLLM's): every chunk with choices carries the usage so far, and
    # every output that has new tokens gets a chunk, even when they decode to no text yet
    CONTINUOUS = "continuous"


def usage_report(options: StreamOptions | None) -> UsageReport:
    """continuous_usage_stats counts only with include_usage, as in vLLM."""
    if options is None or not options.include_usage:
        return UsageReport.NONE
    return UsageReport.CONTINUOUS if options.continuous_usage_stats else UsageReport.FINAL


class _Taken(NamedTuple):
    """What one output added to its choice."""

    tokens: int
    logprobs: list[TokenLogprob]  # empty unless the client asked for them


class _ChoiceProgress:
    """What one choice of a stream has sent so far."""

    def __init__(self) -> None:
        self.tally = Tally()
        self.offset = 0  # characters sent, for logprobs' text_offset
        self.sent_role = False  # chat: the first chunk of a choice carries the role


ChunkUsage = UsageInfo | None | UnsetType  # a chunk's ``usage``: absent, null, or figures


class _Stream:
    """Per-choice progress, the usage of each chunk, and the usage chunk once every choice has
    finished."""

    def __init__(self, n: int, usage: UsageReport, want_logprobs: bool, name: TokenNamer,
                 per_prompt: int | None = None) -> None:
        self._choices = [_ChoiceProgress() for _ in range(n)]
        self._per_prompt = per_prompt  # choices of each prompt (None: all of one prompt)
        self._running = n  # choices without their finish chunk yet
        self._report = usage
        self._want_logprobs = want_logprobs
        self._name = name

    def _take(self, output: TextOutput, progress: _ChoiceProgress) -> _Taken:
        """Count ``output`` (ApiError for a failed choice)."""
        ids = progress.tally.add(output)
        check_finish(output.finish)
        if output.finish is not None:
            self._running -= 1
        return _Taken(len(ids), unpack_logprobs(ids, output.logprobs) if self._want_logprobs else [])

    def _sends(self, output: TextOutput, taken: _Taken) -> bool:
        """Whether ``output`` gets a chunk of its own: with text, logprobs or a finish; with
        continuous usage, with new tokens too (clients count them, and time them, per chunk)."""
        if output.text or taken.logprobs or output.finish is not None:
            return True
        return self._report is UsageReport.CONTINUOUS and taken.tokens > 0

    def _chunk_usage(self, uncounted: int = 0) -> ChunkUsage:
        """The ``usage`` of a chunk with choices: with continuous usage, every token taken so far
        but the last ``uncounted``."""
        if self._report is UsageReport.NONE:
            return UNSET
        if self._report is UsageReport.FINAL:
            return None
        tallies = [progress.tally for progress in self._choices]
        # Each prompt once, as its choices that have reported it say (each does with its first output).
        prompt = merge_usage([tally.usage if tally.reported else None for tally in tallies], self._per_prompt)
        completion = sum(tally.completion_tokens for tally in tallies) - uncounted
        return usage_info(Usage(prompt.prompt_tokens, completion, prompt.cached_tokens))

    def _final_usage(self) -> UsageInfo | None:
        """The request's usage once its last choice has finished, if the client asked for it."""
        if self._running or self._report is UsageReport.NONE:
            return None
        return usage_info(merge_usage([progress.tally.usage for progress in self._choices], self._per_prompt))


class CompletionStream(_Stream):
    """The chunks of a streamed completion, one output at a time (``events`` for EventStream)."""

    def __init__(self, meta: ResponseMeta, n: int, usage: UsageReport, want_logprobs: bool, name: TokenNamer,
                 per_prompt: int | None = None) -> None:
        super().__init__(n, usage, want_logprobs, name, per_prompt)
        self._meta = meta

    def _chunk(self, choices: list[CompletionChoice], usage: ChunkUsage) -> CompletionChunk:
        meta = self._meta
        return CompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=usage)

    def events(self, item: ChoiceOutput) -> list[CompletionChunk]:
        index, output = item
        progress = self._choices[index]
        taken = self._take(output, progress)
        chunks = []
        if self._sends(output, taken):
            logprobs = taken.logprobs
            choice = CompletionChoice(
                index=index,
                text=output.text,
                logprobs=completion_logprobs(logprobs, self._name, progress.offset) if logprobs else None,
                finish_reason=_reason(output.finish),
                matched_stop=_matched(output.finish),
            )
            chunks.append(self._chunk([choice], self._chunk_usage()))
            progress.offset += len(output.text)
        usage = self._final_usage() if output.finish is not None else None
        if usage is not None:
            chunks.append(self._chunk([], usage))
        return chunks


class ChatStream(_Stream):
    """The chunks of a streamed chat completion: per choice, the role first, then content, then
    the finish."""

    def __init__(self, meta: ResponseMeta, n: int, usage: UsageReport, want_logprobs: bool, name: TokenNamer) -> None:
        super().__init__(n, usage, want_logprobs, name)
        self._meta = meta

    def _chunk(self, choices: list[ChatChunkChoice], usage: ChunkUsage) -> ChatCompletionChunk:
        meta = self._meta
        return ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=usage)

    def _delta(self, output: TextOutput) -> Delta:
        """The content: none without text (``{}``), but "" on the chunks that only continuous usage
        sends (tokens without text yet), as vLLM sends them."""
        if output.text or (self._report is UsageReport.CONTINUOUS and output.finish is None):
            return Delta(content=output.text)
        return Delta()

    def events(self, item: ChoiceOutput) -> list[ChatCompletionChunk]:
        index, output = item
        progress = self._choices[index]
        taken = self._take(output, progress)
        chunks = []
        if not progress.sent_role:  # the role comes before this output's tokens (vLLM: 0 tokens, n = 1)
            role = ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))
            chunks.append(self._chunk([role], self._chunk_usage(uncounted=taken.tokens)))
            progress.sent_role = True
        if self._sends(output, taken):
            logprobs = taken.logprobs
            choice = ChatChunkChoice(
                index=index,
                delta=self._delta(output),
                logprobs=chat_logprobs(logprobs, self._name) if logprobs else None,
                finish_reason=_reason(output.finish),
                matched_stop=_matched(output.finish),
            )
            chunks.append(self._chunk([choice], self._chunk_usage()))
        usage = self._final_usage() if output.finish is not None else None
        if usage is not None:
            chunks.append(self._chunk([], usage))
        return chunks
