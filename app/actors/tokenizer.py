"""The tokenizer actor: text and chats in, token ids out; rejects what can never run.

It is the first actor that knows a prompt's length, so it answers too-long prompts and bad
chat templates itself (straight back to the ingress) instead of letting them queue. Aborts
and control messages pass through unchanged, keeping their order with the requests.
Imports no torch: it starts in milliseconds and stays small.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from app.actors.child import ReadyCallback, run_actor
from app.actors.endpoints import Endpoints
from app.actors.faults import FaultPlan, around
from app.actors.heartbeat import Heartbeat, beating
from app.ipc.trace import RequestTrace
from app.ipc.messages import (
    AbortRequest,
    ControlRequest,
    GenerateRequest,
    RequestRejected,
    TokenizedRequest,
    first_outside_vocab,
    pack_tokens,
    unpack_tokens,
)
from app.ipc.ring import FrameTooLargeError
from app.observability.actor_metrics import PublishingInbox, TokenizerMetrics, enabled
from app.observability.logs import get_logger
from app.observability.tracing import actor_tracing
from app.observability.request_log import TokenizerRequestLog
from app.observability.settings import ObservabilitySettings
from app.text.tokenizer import Tokenizer


class Tokenization:
    """Turns one GenerateRequest into a TokenizedRequest, or a RequestRejected."""

    def __init__(self, tokenizer: Tokenizer, *, context_len: int, vocab_size: int,
                 allow_auto_truncate: bool = False) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len
        # --allow-auto-truncate: prompt + max_new_tokens over the context is cut there, not refused
        self.allow_auto_truncate = allow_auto_truncate
        self.vocab_size = vocab_size
        self.log = get_logger()

    def __call__(self, request: GenerateRequest) -> TokenizedRequest | RequestRejected:
        """Never raises: whatever one request holds, the actor goes on with the next."""
        try:
            ids, param = self._token_ids(request)
            request.sampling.validate(vocab_size=self.vocab_size)
        except ValueError as exc:
            return RequestRejected(request.rid, str(exc), 400, getattr(exc, "param", None))
        except Exception:
            self.log.exception("request rejected: tokenization failed", rid=request.rid)
            return RequestRejected(request.rid, "Internal error while tokenizing the request.", 500, None)
        if not ids:
            return RequestRejected(request.rid, "The prompt is empty: at least one token is needed.", 400, param)
        if len(ids) >= self.context_len:
            return RequestRejected(
                request.rid,
                f"The input ({len(ids)} tokens) is longer than the model's context length ({self.context_len} tokens).",
                400,
                param,
            )
        overflow = None if self.allow_auto_truncate else request.sampling.context_overflow(len(ids), self.context_len)
        if overflow is not None:
            return RequestRejected(request.rid, overflow, 400, request.max_tokens_field)
        bad = first_outside_vocab(ids, self.vocab_size)
        if bad is not None:
            return RequestRejected(request.rid, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", 400, param)
        return TokenizedRequest(
            rid=request.rid,
            # ids that came packed travel on as they came
            input_ids=request.input_ids if request.input_ids is not None else pack_tokens(ids),
            sampling=request.sampling,
            stream=request.stream,
            priority=request.priority,
            arrival_time=request.arrival_time,
            traceparent=request.traceparent,
        )

    def _token_ids(self, request: GenerateRequest) -> tuple[list[int], str]:
        """The prompt's ids and the client's name of the field they came from (for error bodies)."""
        if request.input_ids is not None:
            return unpack_tokens(request.input_ids), request.prompt_field
        if request.messages is not None:
            chat = [{"role": m.role, "content": m.content} for m in request.messages]
            text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=request.add_generation_prompt)
            return self.tokenizer.encode(text, add_bos=False), request.prompt_field
        if request.text is not None:
            return self.tokenizer.encode(request.text), request.prompt_field
        raise ValueError("the request has no prompt: give text, input_ids or messages")


async def tokenizer_main(config: dict[str, Any], ready: ReadyCallback) -> None:
    log = get_logger()
    trace = RequestTrace.from_env("tokenizer")
    request_log = TokenizerRequestLog.for_settings(ObservabilitySettings.from_config(config.get("observability")))
    tokenize = Tokenization(
        Tokenizer.from_dir(config["model_path"]), context_len=config["context_len"], vocab_size=config["vocab_size"],
        allow_auto_truncate=config["allow_auto_truncate"],
    )
    with Endpoints("tokenizer", config["channels"]) as channels, actor_tracing(config, "tokenizer") as tracing:
        tokenize_request: Any = tokenize
        if tracing is not None:  # --enable-trace: a span per traced request
            from app.observability.text_spans import TracedTokenization

            tokenize_request = TracedTokenization(tokenize, tracing)
        inbox = channels.receivers["to_tokenizer"]
        to_scheduler = channels.senders["tokenizer_to_scheduler"]
        to_ingress = channels.senders["tokenizer_to_ingress"]
        ready({"vocab_size": tokenize.vocab_size})
        if enabled(config):  # --enable-metrics: tokenizing timed, snapshots sent while the inbox is read
            metrics = TokenizerMetrics()
            tokenize_request, inbox = metrics.timed(tokenize_request), PublishingInbox(inbox, metrics, to_ingress.send)
        tokenize_request = around(FaultPlan.from_env("tokenizer"), "request", tokenize_request)  # tests only
        async for message in beating(inbox, Heartbeat.from_config(config)):  # the watchdog sees each message
            if isinstance(message, GenerateRequest):
                trace.mark("tokenizer.recv", message.rid)
                started = time.perf_counter()
                result = tokenize_request(message)
                if isinstance(result, TokenizedRequest):
                    if request_log is not None:
                        request_log.tokenized(result, started)
                    try:
                        await to_scheduler.send(result)
                        trace.mark("tokenizer.sent", result.rid)
                        continue
                    except FrameTooLargeError as exc:  # a prompt the channel cannot carry: refuse it
                        result = RequestRejected(result.rid, f"The prompt is too large: {exc}", 413, None)
                log.info("request rejected", rid=result.rid, reason=result.message)
                await to_ingress.send(result)
            elif isinstance(message, (AbortRequest, ControlRequest)):
                await to_scheduler.send(message)
        log.info("ingress closed its channel: stopping")


def main() -> None:
    run_actor(sys.argv[-1].removeprefix("app::"), tokenizer_main)


if __name__ == "__main__":
    main()
