"""What the OpenAI and native adapters share to turn a choice's TextOutputs into answers: the
token tally, the usage (merged over a request's choices), and the aborts that are errors."""

from __future__ import annotations

from collections.abc import Sequence

from app.http.errors import ApiError
from app.ipc.messages import (  # noqa: F401 - TokenLogprob and unpack_logprobs are re-exported
    Finish,
    FinishReason,
    TextOutput,
    TokenLogprob,
    Usage,
    unpack_logprobs,
    unpack_tokens,
)

# An ABORT finish with one of these statuses (or none) is an answer, not an error: the client
# (or an operator, through /abort_request) asked for it, and gets finish_reason "abort".
_ANSWERED_ABORT_STATUSES = (None, 499)


def check_finish(finish: Finish | None) -> None:
    """Raise the ApiError a final output stands for, if it is an abort with an error status."""
    if finish is None or finish.reason is not FinishReason.ABORT:
        return
    if finish.status_code not in _ANSWERED_ABORT_STATUSES:
        raise ApiError(finish.status_code, finish.message or "The request was aborted.")


class Tally:
    """What a choice has produced so far: its token count and the latest usage reported."""

    def __init__(self) -> None:
        self.completion_tokens = 0
        self._usage: Usage | None = None

    def add(self, output: TextOutput) -> list[int]:
        """Count ``output``; returns its token ids."""
        ids = unpack_tokens(output.token_ids)
        self.completion_tokens += len(ids)
        if output.usage is not None:
            self._usage = output.usage
        return ids

    @property
    def usage(self) -> Usage:
        """The backend's usage; counted tokens where it sent none (it should, on the final output)."""
        if self._usage is None:
            return Usage(prompt_tokens=0, completion_tokens=self.completion_tokens)
        return self._usage

    @property
    def reported(self) -> bool:
        """Whether the backend has sent a usage yet (ours does with the first output and the final one)."""
        return self._usage is not None


def merge_usage(usages: Sequence[Usage | None], per_prompt: int | None = None) -> Usage:
    """The usage of a request with several choices, as OpenAI counts it: each prompt once.

    ``usages`` are in choice order, ``per_prompt`` choices a prompt (all of them one prompt when
    None); a choice that has not reported yet is None. A prompt's ``cached_tokens`` is the least
    any of its choices found cached, so that it describes that prompt (never more than its
    ``prompt_tokens``) and not the choices' reuse of each other's prefill.
    """
    per = per_prompt or max(1, len(usages))
    prompt = completion = cached = 0
    for start in range(0, len(usages), per):
        reported = [u for u in usages[start:start + per] if u is not None]
        if reported:
            prompt += reported[0].prompt_tokens
            cached += min(u.cached_tokens for u in reported)
            completion += sum(u.completion_tokens for u in reported)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)
