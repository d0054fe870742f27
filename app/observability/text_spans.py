"""The tokenizer's and the detokenizer's spans of each traced request (--enable-trace).

- ``tokenize`` (tokenizer actor): the request's tokenization and checks; ``app.prompt_tokens``,
  or the error status and ``app.status_code`` when it is rejected.
- ``detokenize`` (detokenizer actor): from the request's first output to its final text, with
  ``app.completion_tokens``, ``app.finish_reason`` and ``app.outputs`` (how many outputs it
  turned into text). The request's ``traceparent`` comes with its first output's TextParams.

Both wrap the actor's own work (Tokenization, Detokenization.process) and are only put in
place with --enable-trace; requests without a ``traceparent`` pass straight through.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.ipc.messages import (
    GenerateRequest,
    RequestRejected,
    StopStringHit,
    TextOutput,
    TokenizedRequest,
    TokenOutput,
)
from app.observability.tracing import ProcessTracing, finish_attributes

_TOKEN_BYTES = 4  # packed int32


class TracedTokenization:
    """``tokenize`` (a Tokenization), recording a ``tokenize`` span per traced request."""

    def __init__(self, tokenize: Any, tracing: ProcessTracing) -> None:
        self.tokenize = tokenize
        self.tracing = tracing

    def __call__(self, request: GenerateRequest) -> TokenizedRequest | RequestRejected:
        if request.traceparent is None:
            return self.tokenize(request)
        start = time.time()
        result = self.tokenize(request)
        attributes: dict[str, Any] = {"app.request_id": request.rid}
        error = None
        if isinstance(result, TokenizedRequest):
            attributes["app.prompt_tokens"] = len(result.input_ids) // _TOKEN_BYTES
        else:
            attributes["app.status_code"] = result.status_code
            error = result.message
        self.tracing.span("tokenize", request.traceparent, start, time.time(), attributes, error)
        return result


@dataclass
class _Detokenizing:
    traceparent: str
    started: float
    outputs: int = 0


class TracedDetokenization:
    """``detokenize.process`` (a Detokenization's), recording a ``detokenize`` span per traced
    request, from its first output to its final text."""

    def __init__(self, detokenize: Any, tracing: ProcessTracing) -> None:
        self.detokenize = detokenize
        self.tracing = tracing
        self.open: dict[str, _Detokenizing] = {}

    def process(self, outputs: Sequence[TokenOutput]) -> tuple[list[TextOutput], list[StopStringHit]]:
        start = time.time()
        texts, hits = self.detokenize.process(outputs)
        for output in outputs:
            params = output.text_params  # on a request's first output only
            if params is not None and params.traceparent is not None:
                self.open[output.rid] = _Detokenizing(params.traceparent, start)
        if self.open:
            end = time.time()
            for text in texts:
                traced = self.open.get(text.rid)
                if traced is None:
                    continue
                traced.outputs += 1
                if text.finish is not None:
                    del self.open[text.rid]
                    self._record(text, traced, end)
        return texts, hits

    def _record(self, text: TextOutput, traced: _Detokenizing, end: float) -> None:
        finish = text.finish
        attributes: dict[str, Any] = {"app.request_id": text.rid, "app.outputs": traced.outputs}
        if text.usage is not None:
            attributes["app.completion_tokens"] = text.usage.completion_tokens
            attributes["app.prompt_tokens"] = text.usage.prompt_tokens
        error = finish_attributes(finish, attributes)
        self.tracing.span("detokenize", traced.traceparent, traced.started, end, attributes, error)
