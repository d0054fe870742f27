"""Request logs (--log-requests): each request's life, a line at each moment, in every actor.

Every line has the request id as ``rid`` (the client's X-Request-Id, the body's rid, or ours;
choices of n > 1 run as ``<rid>-0``, ``<rid>-1``…), so one ``grep`` or one log query follows a
request through the four processes::

    ingress      request arrived       (level 1: sampling parameters; 2: the prompt)
    tokenizer    request tokenized     prompt tokens, time taken (level 3: the token ids)
    scheduler    request admitted      queue time, cached tokens (again after a retraction)
    scheduler    request first token   time to first token
    scheduler    request retracted     back to the queue for lack of KV (or ``preempted``)
    scheduler    request finished      finish reason, status, tokens, queue/TTFT/end-to-end
                                       (level 3: the output token ids)
    detokenizer  request detokenized   finish reason as the text ended, stop string matched
    ingress      request finished      status, finish reason, tokens, TTFT and end-to-end as
                                       the HTTP layer saw them (level 2: the output text)

Levels (--log-requests-level): 0 metadata only; 1 adds the sampling parameters; 2 adds the
prompt and the output text cut to :data:`TEXT_LIMIT` characters; 3 everything, uncut, token
ids included. The scheduler's lines come from app.observability.scheduler_log (which imports
the engine; this module stays light for the tokenizer, detokenizer and ingress). Nothing here sees HTTP headers, so the Authorization header and API keys can
never reach these lines. Off (the default), the actors hold None instead of these objects and
pay one ``is None`` check per moment.

docs/logging.md lists every key.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from app.ipc.messages import GenerateRequest, TextOutput, TokenizedRequest, unpack_tokens
from app.observability.logs import get_logger
from app.observability.settings import ObservabilitySettings

TEXT_LIMIT = 2048  # characters of prompt and output text at level 2
SAMPLING, TEXT, EVERYTHING = 1, 2, 3  # the levels that add something


def ms(seconds: float) -> float:
    """Seconds as milliseconds, to the microsecond."""
    return round(seconds * 1000, 3)


def request_log_level(settings: ObservabilitySettings) -> int | None:
    """The request-log level, None when --log-requests is off."""
    return settings.log_requests_level if settings.log_requests else None


class Detail:
    """What a request-log level adds to the lines."""

    def __init__(self, level: int) -> None:
        self.level = level
        self.text_limit = None if level >= EVERYTHING else TEXT_LIMIT

    def clip(self, text: str) -> str:
        return text if self.text_limit is None else text[: self.text_limit]


# ---------------------------------------------------------------------------------- ingress


@dataclass
class _Timeline:
    """What the ingress remembers of one request until it finishes."""

    arrived: float = field(default_factory=time.perf_counter)
    first_output: float | None = None
    text: list[str] = field(default_factory=list)  # level >= 2
    chars: int = 0


class IngressRequestLog:
    """The ingress's lines: a request's arrival, and its finish as the client gets it."""

    def __init__(self, level: int) -> None:
        self.detail = Detail(level)
        self.requests: dict[str, _Timeline] = {}
        self.log = get_logger()

    @classmethod
    def for_settings(cls, settings: ObservabilitySettings) -> IngressRequestLog | None:
        level = request_log_level(settings)
        return None if level is None else cls(level)

    def arrived(self, request: GenerateRequest) -> None:
        self.requests[request.rid] = _Timeline()
        fields: dict[str, Any] = {"stream": request.stream, "priority": request.priority}
        if request.text is not None:
            fields["prompt_chars"] = len(request.text)
        if request.input_ids is not None:
            fields["prompt_token_ids"] = len(request.input_ids) // 4  # packed int32
        if request.messages is not None:
            fields["messages"] = len(request.messages)
        if self.detail.level >= SAMPLING:
            fields["sampling"] = msgspec.to_builtins(request.sampling)
        if self.detail.level >= TEXT:
            if request.text is not None:
                fields["prompt"] = self.detail.clip(request.text)
            if request.messages is not None:
                fields["chat"] = [{"role": m.role, "content": self.detail.clip(m.content)} for m in request.messages]
        if self.detail.level >= EVERYTHING and request.input_ids is not None:
            fields["input_ids"] = unpack_tokens(request.input_ids)
        self.log.info("request arrived", rid=request.rid, **fields)

    def delivered(self, rid: str, answer: Any, last: bool) -> None:
        """One answer went to the request's reader (a TextOutput, or a Failure)."""
        timeline = self.requests.get(rid)
        if timeline is None:
            return
        if timeline.first_output is None:
            timeline.first_output = time.perf_counter()
        text = getattr(answer, "text", None)
        if text and self.detail.level >= TEXT and (self.detail.text_limit is None or timeline.chars < self.detail.text_limit):
            timeline.text.append(text)
            timeline.chars += len(text)
        if last:
            self._finished(rid, timeline, answer)

    def forgotten(self, rid: str) -> None:
        """The reader let the request go; one without its last answer was cancelled (client gone)."""
        timeline = self.requests.get(rid)
        if timeline is not None:
            self._finished(rid, timeline, None)

    def _finished(self, rid: str, timeline: _Timeline, answer: Any) -> None:
        del self.requests[rid]
        now = time.perf_counter()
        fields: dict[str, Any] = {}
        if isinstance(answer, TextOutput):
            finish = answer.finish
            fields["finish_reason"] = finish.reason.value if finish is not None else None
            fields["status"] = (finish.status_code or 500) if finish is not None and finish.status_code else 200
            if answer.usage is not None:
                fields.update(prompt_tokens=answer.usage.prompt_tokens, completion_tokens=answer.usage.completion_tokens,
                              cached_tokens=answer.usage.cached_tokens)
        elif answer is None:
            fields.update(finish_reason="cancelled", status=499)
        else:  # a Failure: rejected, or the server failed
            error = answer.error
            fields.update(finish_reason="error", status=getattr(error, "status_code", 500),
                          error=getattr(error, "message", str(error)))
        ttft = None if timeline.first_output is None else ms(timeline.first_output - timeline.arrived)
        fields.update(ttft_ms=ttft, e2e_ms=ms(now - timeline.arrived))
        if self.detail.level >= TEXT:
            fields["output"] = self.detail.clip("".join(timeline.text))
        self.log.info("request finished", rid=rid, **fields)


# ---------------------------------------------------------------------------------- tokenizer


class TokenizerRequestLog:
    """The tokenizer's line: how many tokens the prompt became, and how long that took."""

    def __init__(self, level: int) -> None:
        self.detail = Detail(level)
        self.log = get_logger()

    @classmethod
    def for_settings(cls, settings: ObservabilitySettings) -> TokenizerRequestLog | None:
        level = request_log_level(settings)
        return None if level is None else cls(level)

    def tokenized(self, request: TokenizedRequest, started: float) -> None:
        """``request`` left for the scheduler; ``started``: time.perf_counter() before tokenizing."""
        fields: dict[str, Any] = {"prompt_tokens": len(request.input_ids) // 4,
                                  "tokenize_ms": ms(time.perf_counter() - started)}
        if self.detail.level >= EVERYTHING:
            fields["input_ids"] = unpack_tokens(request.input_ids)
        self.log.info("request tokenized", rid=request.rid, **fields)


# ---------------------------------------------------------------------------------- detokenizer


class DetokenizerRequestLog:
    """The detokenizer's line: how each request's text ended (a stop string it matched)."""

    def __init__(self, level: int) -> None:
        self.log = get_logger()

    @classmethod
    def for_settings(cls, settings: ObservabilitySettings) -> DetokenizerRequestLog | None:
        level = request_log_level(settings)
        return None if level is None else cls(level)

    def outputs(self, texts: list[TextOutput]) -> None:
        for output in texts:
            finish = output.finish
            if finish is None:
                continue
            fields: dict[str, Any] = {"finish_reason": finish.reason.value}
            if isinstance(finish.matched, str):
                fields["stop_string"] = finish.matched
            if output.usage is not None:
                fields["completion_tokens"] = output.usage.completion_tokens
            self.log.info("request detokenized", rid=output.rid, **fields)
