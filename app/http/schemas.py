"""Request and response bodies of every route, as msgspec Structs.

Decoding into these Structs is the validation: a wrong type, a missing field or a number
outside its range is a ``msgspec.ValidationError`` that names the field (``errors.from_validation``
turns it into a 400). Every number a client sends has its range here (the ``Meta`` bounds below,
documented in docs/security.md), so nothing that reaches a channel or a tensor can overflow; the
same Structs generate the OpenAPI document (``openapi.py``), so API fuzzers see the ranges.
``SamplingParams.validate`` checks the same ranges again behind the channels (defence in depth)
and what depends on the model (token ids against the vocabulary).

Unknown fields are ignored in OpenAI bodies, as OpenAI does, but refused inside the native
``sampling_params``, where a misspelt name would otherwise be silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from app.ipc.messages import (
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TIMEOUT_S,
    MAX_TOP_LOGPROBS,
)

MAX_REQUEST_ID_CHARS = 256  # X-Request-Id and the native ``rid``

# ---------------------------------------------------------------- ranges of client numbers

MAX_CHOICES = 16  # OpenAI's ``n``: each choice is a request of its own in the scheduler
MAX_PROMPTS = 256  # prompts in one /v1/completions request (a batch: each fans out to n choices)

# Token counts and ids travel as int32 (the channels pack ids as int32; the sampler's tensors are
# int64): larger numbers are refused here. A count up to this bound is then clipped by the
# context length in the scheduler.
TokenCount = Annotated[int, Meta(ge=0, le=MAX_INT32)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_INT32)]
Temperature = Annotated[float, Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1, le=MAX_INT32)]  # -1 or 0: off
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]  # frequency and presence
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
Seed = Annotated[int, Meta(ge=0, le=MAX_SEED)]
LogprobCount = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
Priority = Annotated[int, Meta(ge=-MAX_INT32 - 1, le=MAX_INT32)]
# Seconds: ``waiting_timeout`` (in the queue until the prefill starts) and ``timeout`` (from arrival
# to the end); the server's --waiting-timeout / --request-timeout cap them; past either, 503.
TimeoutSeconds = Annotated[float, Meta(gt=0.0, le=MAX_TIMEOUT_S)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
StopStrings = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None
StopTokenIds = Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]
# Token id (a string: JSON object keys are strings) -> bias; ids are checked against the vocabulary.
TokenIdKey = Annotated[str, Meta(pattern="^[0-9]{1,10}$")]
LogitBias = Annotated[dict[TokenIdKey, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=MAX_LOGIT_BIAS)]
# Logged, and sent back in the X-Request-Id header: printable ASCII.
RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS, pattern="^[ -~]+$")]

# ---------------------------------------------------------------- OpenAI: requests


class StreamOptions(Struct, frozen=True, kw_only=True):
    include_usage: bool = False  # one more chunk, with empty choices and the request's usage
    # vLLM's extension, with include_usage: every chunk with choices also carries the usage so far
    # (and one is sent for every output, even one whose new tokens decode to no text yet)
    continuous_usage_stats: bool = False


class OpenAISampling(Struct, frozen=True, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions. ``None`` means the server's
    default (the model's generation_config.json where it has one)."""

    model: str | None = None  # must name the served model when given
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] = 1  # choices of each prompt
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    stop: StopStrings = None
    user: str | None = None  # accepted and ignored, as an end-user id
    logit_bias: LogitBias | None = None  # token id (as a string) -> bias in [-100, 100]
    # SGLang's extensions
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: TokenCount | None = None
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds | None = None
    skip_special_tokens: bool | None = None
    # Our extensions: per-request timeouts in seconds (see TimeoutSeconds)
    waiting_timeout: TimeoutSeconds | None = None
    timeout: TimeoutSeconds | None = None
    priority: Priority | None = None  # SGLang's; 400 unless --enable-priority-scheduling


# A string, token ids, or a batch: a list of strings or of lists of token ids (none empty).
NonEmptyText = Annotated[str, Meta(min_length=1)]
PromptInput = NonEmptyText | Annotated[list[NonEmptyText | TokenId | Annotated[list[TokenId], Meta(min_length=1)]],
                                       Meta(min_length=1)]


class CompletionRequest(OpenAISampling, frozen=True, kw_only=True):
    """POST /v1/completions."""

    prompt: PromptInput
    max_tokens: TokenCount | None = 16  # null: up to the context length
    logprobs: LogprobCount | None = None  # this many alternatives per token (0: only the chosen one)
    echo: bool = False  # refused when true
    suffix: str | None = None  # refused when given
    best_of: Annotated[int, Meta(ge=1, le=1)] | None = None  # only 1: n choices are n requests


class TextPart(Struct, frozen=True, kw_only=True):
    type: str  # only "text" is supported
    text: str | None = None


class ChatMessageIn(Struct, frozen=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class TextFormat(Struct, frozen=True, kw_only=True):
    """OpenAI's ``response_format``: only plain text so far (JSON modes are refused)."""

    type: Literal["text"]


class ChatCompletionRequest(OpenAISampling, frozen=True, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)]
    max_tokens: TokenCount | None = None  # deprecated by OpenAI for the next one
    max_completion_tokens: TokenCount | None = None  # null: up to the context
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None  # needs logprobs: true
    add_generation_prompt: bool = True
    # Refused when given: features we do not support yet.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    response_format: TextFormat | None = None


# ---------------------------------------------------------------- OpenAI: responses


class PromptTokensDetails(Struct, frozen=True):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(Struct, frozen=True, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Struct, frozen=True, kw_only=True):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    matched_stop: int | str | None = None  # the stop string or token id that ended it (SGLang)


class CompletionResponse(Struct, frozen=True, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(Struct, frozen=True, kw_only=True):
    """One SSE event of a streamed completion; ``usage`` is present only with include_usage (null
    but in the last chunk, or the usage so far in every chunk with continuous_usage_stats)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None | UnsetType = UNSET


class TopLogprob(Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct, frozen=True, kw_only=True):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(Struct, frozen=True, kw_only=True):
    role: str = "assistant"
    content: str


class ChatChoice(Struct, frozen=True, kw_only=True):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None
    matched_stop: int | str | None = None


class ChatCompletionResponse(Struct, frozen=True, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class Delta(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a chat chunk adds: the role once, first; then content; ``{}`` on a bare final chunk."""

    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatChunkChoice(Struct, frozen=True, kw_only=True):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(Struct, frozen=True, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None | UnsetType = UNSET


class ModelObject(Struct, frozen=True, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "app"
    root: str  # the checkpoint path
    max_model_len: int


class ModelList(Struct, frozen=True, kw_only=True):
    object: str = "list"
    data: list[ModelObject]


# ---------------------------------------------------------------- native (SGLang) routes


class NativeSamplingParams(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``sampling_params`` of POST /generate, with SGLang's names. Unset means the default."""

    max_new_tokens: TokenCount | None = None
    min_new_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: StopStrings = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    sampling_seed: Seed | None = None  # SGLang's name for the seed
    logit_bias: LogitBias | None = None  # token id (as a string) -> bias in [-100, 100]
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] = 1
    waiting_timeout: TimeoutSeconds | None = None  # also accepted at the top level of the body
    timeout: TimeoutSeconds | None = None


class GenerateBody(Struct, frozen=True, kw_only=True):
    """POST /generate: exactly one of ``text`` and ``input_ids``."""

    text: str | None = None
    input_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None
    sampling_params: NativeSamplingParams = NativeSamplingParams()
    stream: bool = False
    rid: RequestId | None = None  # the request id; the X-Request-Id header or a fresh one otherwise
    return_logprob: bool = False
    top_logprobs_num: LogprobCount = 0
    priority: Priority | None = None  # 400 unless --enable-priority-scheduling; None: --default-priority-value
    waiting_timeout: TimeoutSeconds | None = None  # sampling_params' value wins when both are given
    timeout: TimeoutSeconds | None = None


# What the Structs above cannot say of themselves, for the OpenAPI document (merged into each
# Struct's schema): what is refused because it is not supported yet; that /generate takes exactly
# one of `text` and `input_ids`, and /abort_request a `rid` or `abort_all: true`.
SCHEMA_EXTRAS: dict[str, dict[str, Any]] = {
    "CompletionRequest": {"properties": {"echo": {"const": False}, "suffix": {"type": "null"}}},
    "ChatCompletionRequest": {"properties": {
        "tools": {"maxItems": 0}, "functions": {"maxItems": 0}, "tool_choice": {"enum": [None, "none", "auto"]}}},
    "GenerateBody": {"oneOf": [
        {"required": ["text"], "properties": {"text": {"type": "string"}}},
        {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}},
    ]},
    "AbortBody": {"anyOf": [
        {"required": ["rid"], "properties": {"rid": {"type": "string"}}},
        {"required": ["abort_all"], "properties": {"abort_all": {"const": True}}},
    ]},
}


class NativeFinishReason(Struct, frozen=True, kw_only=True):
    """SGLang's finish reason: {"type": "stop", "matched": ...}, {"type": "length", "length": n},
    {"type": "abort", "message": ...}."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None | UnsetType = UNSET
    length: int | UnsetType = UNSET
    message: str | None | UnsetType = UNSET


PRODUCED_AT_DOC = (
    "server host time.monotonic() when these tokens were produced; for same-host latency measurements"
)

# (logprob, token id, token text or null), as SGLang returns them.
NativeLogprob = tuple[float, int, str | None]


class MetaInfo(Struct, frozen=True, kw_only=True):
    id: str
    finish_reason: NativeFinishReason | None  # null while a stream is still running
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float  # seconds since the request arrived
    # The scheduler's step that made the newest tokens ended then; null when the backend does not say.
    produced_at: Annotated[float | None, Meta(description=PRODUCED_AT_DOC)] = None
    output_token_logprobs: list[NativeLogprob] | UnsetType = UNSET
    output_top_logprobs: list[list[NativeLogprob]] | UnsetType = UNSET


class GenerateResponse(Struct, frozen=True, kw_only=True):
    """The answer of POST /generate; when streaming, every event holds the text so far.

    With ``sampling_params.n`` > 1 the answer is a list of these, and ``index`` says which
    choice each (streamed) response belongs to.
    """

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | UnsetType = UNSET


class AbortBody(Struct, frozen=True, kw_only=True):
    rid: RequestId | None = None
    abort_all: bool = False


class AbortResult(Struct, frozen=True, kw_only=True):
    success: bool  # false: no such request in flight


class ModelInfo(Struct, frozen=True, kw_only=True):
    model_path: str
    served_model_name: str
    is_generation: bool = True
    context_length: int
    vocab_size: int
    architecture: str


class HealthStatus(Struct, frozen=True, kw_only=True):
    status: str  # the server state: "serving"


class ControlResult(Struct, frozen=True, kw_only=True):
    success: bool
    message: str
    payload: Any = None  # the control reply's JSON, when it has one

