"""Output reporting: the TokenOutput messages a step hands to the detokenizer.

A request reports its new tokens (streamed requests and those with stop strings as they come,
every ``stream_interval`` tokens; others once, when they finish) and ends with exactly one
output that carries its finish. Outputs made between steps (aborts, refusals) wait here and go
with the next step's. Every output and finish passes through :meth:`OutputReporter.report`, the
place to count tokens, finishes and latencies for metrics.
"""

from __future__ import annotations

import time

from app.engine.request import Request
from app.ipc.messages import (
    Finish,
    FinishReason,
    TextParams,
    TokenLogprobs,
    TokenOutput,
    Usage,
    pack_floats,
    pack_tokens,
)


class OutputReporter:
    """Collects the outputs of the requests until the step hands them out."""

    def __init__(self) -> None:
        self.pending: list[TokenOutput] = []  # outputs produced since the last take()

    def take(self) -> list[TokenOutput]:
        """The outputs collected since the last call, in the order they were made."""
        outputs, self.pending = self.pending, []
        return outputs

    def refuse(self, rid: str, message: str, status_code: int) -> None:
        """Answer a request that was never queued with an error finish."""
        self.pending.append(TokenOutput(rid, b"", Finish(FinishReason.ABORT, message=message, status_code=status_code)))

    def report(self, req: Request) -> None:
        """Queue the tokens ``req`` has not reported yet (and its finish, if it has one)."""
        new_tokens = req.output_ids[req.sent_tokens :]
        first = not req.reported
        req.reported = True
        req.sent_tokens = len(req.output_ids)
        logprobs = None
        if req.params.logprobs and req.pending_logprobs:
            k = req.params.top_logprobs
            logprobs = TokenLogprobs(
                chosen=pack_floats(req.pending_logprobs),
                top_ids=pack_tokens([t for row in req.pending_top_ids for t in row]) if k else b"",
                top_logprobs=pack_floats([p for row in req.pending_top_logprobs for p in row]) if k else b"",
                k=k,
            )
            req.pending_logprobs, req.pending_top_ids, req.pending_top_logprobs = [], [], []
        usage = text_params = None
        if first or req.finish is not None:
            usage = Usage(len(req.prompt_ids), len(req.output_ids), req.cached_tokens)
        if first:
            p = req.params
            text_params = TextParams(p.stop, p.skip_special_tokens, pack_tokens(req.prompt_ids[-5:]), req.traceparent)
        self.pending.append(
            TokenOutput(req.rid, pack_tokens(new_tokens), req.finish, usage, logprobs, text_params, time.monotonic())
        )
