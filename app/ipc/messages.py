"""The whole protocol between actors: every message is a msgspec Struct in this one file.

Channel graph (see the README for the picture):

    ingress ──ToTokenizer──▶ tokenizer ──ToScheduler──▶ scheduler ──ToDetokenizer──▶ detokenizer
       ▲                        │                          ▲                           │
       │◀──────ToIngress────────┘ (rejections)             └───ToScheduler (stop hit)──┤
       └───────────────────────────────ToIngress (text, control replies)◀──────────────┘

Each channel decodes exactly one tagged union (``ToTokenizer``, ``ToScheduler``, ...), so a
message that does not belong on a channel is a decode error, not a silent surprise. Structs are
``array_like`` (no field names on the wire) and hot ones are ``gc=False`` (they hold no cycles).

Token ids travel packed as little-endian int32 bytes (:func:`pack_tokens`), not as lists of ints:
a 4k-token prompt is one 16 KiB memcpy instead of 4k msgpack integers.
"""

from __future__ import annotations

import enum
import sys
from array import array
from typing import NamedTuple, Union

import msgspec

_TOKEN_ITEMSIZE = 4


def pack_tokens(token_ids: "list[int] | array | bytes") -> bytes:
    """Pack token ids as little-endian int32 bytes (the wire form of every token list)."""
    if isinstance(token_ids, bytes):
        return token_ids
    packed = token_ids if isinstance(token_ids, array) and token_ids.typecode == "i" else array("i", token_ids)
    if sys.byteorder != "little":
        packed = array("i", packed)
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(packed: bytes) -> list[int]:
    """Inverse of :func:`pack_tokens`; raises ValueError on a length that is not whole int32s."""
    if len(packed) % _TOKEN_ITEMSIZE:
        raise ValueError(f"packed token ids have {len(packed)} bytes, not a multiple of {_TOKEN_ITEMSIZE}")
    tokens = array("i")
    tokens.frombytes(packed)
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens.tolist()


def first_outside_vocab(token_ids: "list[int]", vocab_size: int) -> int | None:
    """The first id outside ``[0, vocab_size)``, or None. ``min`` and ``max`` look at every id
    in C; the Python loop that names the culprit runs only when there is one."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return None
    return next(t for t in token_ids if not 0 <= t < vocab_size)


def pack_floats(values: "list[float] | array") -> bytes:
    """Little-endian float32 bytes (the wire form of log-probabilities)."""
    packed = array("f", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_floats(packed: bytes) -> list[float]:
    values = array("f")
    values.frombytes(packed)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


class _Message(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Base of every message: tagged (the class name is the tag) and encoded as an array."""


class _HotMessage(_Message, gc=False):
    """A message sent per request or per step: no reference cycles, so the GC can skip it."""


# ---------------------------------------------------------------- request parameters


# Ranges of what a request carries; the HTTP schemas check the same ones first (docs/security.md).
MAX_INT32 = 2**31 - 1  # token counts and ids: the channels pack ids as int32
MAX_SEED = 2**63 - 1  # seeds are int64 in the sampler
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # one stop string: the detokenizer holds back this much text while it matches
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_LOGPROBS = 20
MAX_TIMEOUT_S = 86400.0  # a per-request timeout: at most a day (a number, never unbounded)
QUEUE_FULL_MESSAGE = "The request queue is full."  # SGLang's 503 message, which clients match on


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """How to sample one request. Defaults follow SGLang's (users know them).

    ``validate()`` checks every range. The HTTP schemas check the same ranges first (so that an
    error names the client's own field), and the scheduler checks again on arrival, so that one
    malformed request is refused instead of reaching a tensor.
    """

    max_new_tokens: int = 128
    # True: max_new_tokens is what the request asks for, so a prompt + max_new_tokens over the
    # context is refused (400) unless --allow-auto-truncate; False: the client left it out (the
    # default stands), and the request may run to the context and end there with "length"
    max_new_tokens_given: bool = True
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # same seed, same output, whatever shares the batch
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False  # return the log-probability of each chosen token
    top_logprobs: int = 0  # and this many alternatives per position
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias: -100 bans
    # a token, +100 all but forces it); a pair per token id
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Seconds this request may wait in the scheduler's queue before its prefill starts, and from
    # its arrival to its end; None: the server's --waiting-timeout / --request-timeout (each caps
    # these). Past either the scheduler aborts it with 503.
    waiting_timeout: float | None = None
    timeout: float | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first out-of-range field (NaN is out of every range)."""
        checks: list[tuple[bool, str, str]] = [
            (0 <= self.max_new_tokens <= MAX_INT32, "max_new_tokens", "must be in [0, 2**31 - 1]"),
            (0 <= self.min_new_tokens <= MAX_INT32, "min_new_tokens", "must be in [0, 2**31 - 1]"),
            (self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", "must be <= max_new_tokens"),
            (0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (-1 <= self.top_k <= MAX_INT32, "top_k", "must be -1 (disabled) or in [0, 2**31 - 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]"),
            (self.seed is None or 0 <= self.seed <= MAX_SEED, "seed", "must be in [0, 2**63 - 1]"),
            (all(self.stop), "stop", "must not contain empty strings"),
            (len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings"),
            (all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop", f"at most {MAX_STOP_CHARS} characters each"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids"),
            (all(0 <= t <= MAX_INT32 for t in self.stop_token_ids), "stop_token_ids", "must be in [0, 2**31 - 1]"),
            (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens"),
            (all(0 <= t <= MAX_INT32 for t, _ in self.logit_bias), "logit_bias", "token ids must be in [0, 2**31 - 1]"),
            (all(-100.0 <= b <= 100.0 for _, b in self.logit_bias), "logit_bias", "values must be in [-100, 100]"),
            (len({token for token, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias", "names a token twice"),
            (self.waiting_timeout is None or 0.0 < self.waiting_timeout <= MAX_TIMEOUT_S, "waiting_timeout",
             f"must be in (0, {MAX_TIMEOUT_S:g}] seconds"),
            (self.timeout is None or 0.0 < self.timeout <= MAX_TIMEOUT_S, "timeout",
             f"must be in (0, {MAX_TIMEOUT_S:g}] seconds"),
        ]
        for ok, field, why in checks:
            if not ok:
                raise ValueError(f"{field} {why}, got {getattr(self, field)!r}")
        if vocab_size is not None:
            for token in self.stop_token_ids:
                if not 0 <= token < vocab_size:
                    raise ValueError(f"stop_token_ids holds {token}, outside the vocabulary [0, {vocab_size})")
            for token, _ in self.logit_bias:
                if not 0 <= token < vocab_size:
                    raise ValueError(f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def context_overflow(self, prompt_len: int, context_len: int) -> str | None:
        """Why this request cannot be served whole within ``context_len`` tokens (OpenAI's and
        vLLM's wording), or None when it fits or did not ask for a length (it then ends at the
        context with "length")."""
        total = prompt_len + self.max_new_tokens
        if not self.max_new_tokens_given or total <= context_len:
            return None
        return (
            f"This model's maximum context length is {context_len} tokens. However, you requested {total} tokens "
            f"({prompt_len} in the prompt, {self.max_new_tokens} for the completion). Please reduce the length of "
            "the prompt or the completion."
        )


class ChatMessage(msgspec.Struct, frozen=True, array_like=True):
    role: str
    content: str


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # client gone, /abort_request, shutdown, or an error


class Finish(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Why a request ended. ``matched`` is the stop string or stop token that ended it."""

    reason: FinishReason
    matched: str | int | None = None
    message: str | None = None  # for ABORT: what happened, shown to the client
    status_code: int | None = None  # for ABORT: the HTTP status the client gets


class Usage(msgspec.Struct, frozen=True, array_like=True, gc=False):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Log-probabilities for a run of chosen tokens (raw model distribution, before sampling
    transforms, as OpenAI reports them). ``top_ids``/``top_logprobs`` are row-major
    [n_tokens, k] flattened, so they travel packed too."""

    chosen: bytes  # float32 per token
    top_ids: bytes = b""  # int32, n_tokens * k
    top_logprobs: bytes = b""  # float32, n_tokens * k
    k: int = 0


class TokenLogprob(NamedTuple):
    """One chosen token's log-probability and its top alternatives, unpacked."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


def unpack_logprobs(token_ids: list[int], packed: TokenLogprobs | None) -> list[TokenLogprob]:
    """The per-token log-probabilities of one output; [] when none were asked for."""
    if packed is None:
        return []
    k = packed.k
    chosen = unpack_floats(packed.chosen)
    top_ids = unpack_tokens(packed.top_ids) if k else []
    top_lps = unpack_floats(packed.top_logprobs) if k else []
    return [
        TokenLogprob(token, logprob, list(zip(top_ids[i * k : (i + 1) * k], top_lps[i * k : (i + 1) * k])))
        for i, (token, logprob) in enumerate(zip(token_ids, chosen))
    ]


# ---------------------------------------------------------------- ingress → tokenizer


class GenerateRequest(_HotMessage):
    """A client request as the HTTP layer received it, before tokenization.

    Exactly one of ``text``, ``input_ids`` (packed) or ``messages`` (a chat) is set.
    """

    rid: str
    sampling: SamplingParams
    stream: bool = False
    text: str | None = None
    input_ids: bytes | None = None
    messages: tuple[ChatMessage, ...] | None = None
    add_generation_prompt: bool = True
    priority: int = 0
    arrival_time: float = 0.0  # time.time() at the HTTP layer
    prompt_field: str = "prompt"  # the client's name for the prompt, named by a rejection (400's param)
    max_tokens_field: str = "max_new_tokens"  # the client's name for max_new_tokens, likewise
    traceparent: str | None = None  # W3C trace context of the request's HTTP span (--enable-trace)


class AbortRequest(_HotMessage):
    """Abort one request (``rid``) or all (``rid`` None). Travels the request path so that it
    reaches the scheduler after the request it refers to."""

    rid: str | None
    message: str = "aborted"
    status_code: int = 499


class ControlKind(enum.Enum):
    HEALTH_CHECK = "health_check"
    FLUSH_CACHE = "flush_cache"
    DUMP_STATE = "dump_state"
    SERVER_INFO = "server_info"
    SHUTDOWN = "shutdown"


class ControlRequest(_Message):
    """A control command for every actor on the path; the scheduler answers with ControlReply."""

    id: int
    kind: ControlKind


# ---------------------------------------------------------------- tokenizer → scheduler


class TokenizedRequest(_HotMessage):
    rid: str
    input_ids: bytes  # packed int32
    sampling: SamplingParams
    stream: bool = False
    priority: int = 0
    arrival_time: float = 0.0
    traceparent: str | None = None  # W3C trace context: the scheduler's spans join the request's trace


# ---------------------------------------------------------------- scheduler → detokenizer


class TextParams(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What the detokenizer needs to turn one request's tokens into text; sent once, with the
    request's first output."""

    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    prompt_tail: bytes = b""  # packed int32: the last prompt tokens, for the first token's spacing
    traceparent: str | None = None  # W3C trace context (--enable-trace): the detokenizer's span joins the trace


class TokenOutput(_HotMessage):
    """New tokens of one request since its last output. ``finish`` set means this is its last.

    After the detokenizer reported a stop string (StopStringHit), exactly one more output
    with ``finish`` set arrives for that request; the detokenizer drops it.
    """

    rid: str
    token_ids: bytes  # packed int32
    finish: Finish | None = None
    usage: Usage | None = None  # on the first and the final output
    logprobs: TokenLogprobs | None = None
    text_params: TextParams | None = None  # on the first output
    produced_at: float = 0.0  # time.monotonic() when the step that made these tokens ended


class StepOutput(_HotMessage):
    """Everything one scheduler step produced: one message per step, not per request."""

    outputs: tuple[TokenOutput, ...]


# ---------------------------------------------------------------- detokenizer → scheduler


class StopStringHit(_HotMessage):
    """The detokenizer saw a stop string: the scheduler must end the request. The client has
    already had its final answer; the scheduler's last output for it only closes the books."""

    rid: str
    stop: str


# ---------------------------------------------------------------- → ingress


class TextOutput(_HotMessage):
    """New text of one request. ``finish`` set means this is the request's final answer."""

    rid: str
    text: str
    token_ids: bytes  # packed int32, the tokens behind ``text``
    finish: Finish | None = None
    usage: Usage | None = None
    logprobs: TokenLogprobs | None = None
    produced_at: float = 0.0  # the scheduler's time.monotonic() for these tokens (latency figures)


class TextBatch(_HotMessage):
    outputs: tuple[TextOutput, ...]


class RequestRejected(_HotMessage):
    """The request never reached the scheduler (too long, bad template, ...): a client error."""

    rid: str
    message: str
    status_code: int = 400
    param: str | None = None


class ControlReply(_Message):
    id: int
    kind: ControlKind
    ok: bool
    payload: bytes = b""  # JSON, shape depends on kind
    error: str | None = None


# ---------------------------------------------------------------- per-channel unions

# ---------------------------------------------------------------- metrics (every actor → ingress)


class MetricSample(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One sample of a metric family, as prometheus_client's collectors give it."""

    name: str  # with its suffix (``_bucket``, ``_sum``, ``_count``, ``_total``)
    labels: tuple[tuple[str, str], ...]
    value: float


class MetricFamily(msgspec.Struct, frozen=True, array_like=True, gc=False):
    name: str
    kind: str  # counter, gauge, histogram
    documentation: str
    samples: tuple[MetricSample, ...]


class MetricsSnapshot(_Message):
    """An actor's metrics, whole (cumulative, not deltas): the ingress's registry shows the
    latest snapshot of each actor (--enable-metrics). The scheduler's travel through the
    detokenizer, behind the outputs sent before them."""

    actor: str
    families: tuple[MetricFamily, ...]


# ---------------------------------------------------------------- a worker lane's ingress and the supervisor


class WorkerCommandKind(enum.Enum):
    FAIL = "fail"  # the server failed: answer every open request with ``message`` and stop
    DRAIN = "drain"  # SIGTERM: refuse new requests, let those in flight finish, then stop
    METRICS = "metrics"  # ``payload``: the whole server's /metrics text, for a scrape that lands here


class WorkerCommand(_Message):
    """The supervisor to a worker lane's ingress (app/actors/ingress_worker.py)."""

    kind: WorkerCommandKind
    message: str = ""
    status_code: int = 500
    error_type: str = "InternalServerError"
    payload: bytes = b""


ToTokenizer = Union[GenerateRequest, AbortRequest, ControlRequest]
ToScheduler = Union[TokenizedRequest, AbortRequest, ControlRequest, StopStringHit]
ToDetokenizer = Union[StepOutput, ControlReply, MetricsSnapshot]
ToIngress = Union[TextBatch, RequestRejected, ControlReply, MetricsSnapshot]
ToIngressWorker = WorkerCommand
FromIngressWorker = MetricsSnapshot  # its own and its lane's actors' metrics, for the supervisor's /metrics
