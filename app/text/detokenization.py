"""Token outputs to text outputs, for the detokenizer actor and the offline Engine alike.

Per request it keeps an incremental decoder (a multi-byte character split across tokens is
held until complete) and a stop-string matcher (text that could still become a stop string is
held back). When a stop string matches, the request's final text is produced at once and a
StopStringHit tells the scheduler to end the request; the one closing output the scheduler then
sends for it is dropped. At a normal finish everything held back is flushed, so streamed and
non-streamed text are identical. Without a tokenizer (a checkpoint of weights only) the text is
empty and only the tokens travel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.ipc.messages import (
    Finish,
    FinishReason,
    StopStringHit,
    TextOutput,
    TextParams,
    TokenOutput,
    Usage,
    unpack_tokens,
)
from app.text.incremental_detokenize import IncrementalDetokenizer
from app.text.stop_strings import StopStringMatcher
from app.text.tokenizer import Tokenizer


@dataclass
class _RequestText:
    decoder: IncrementalDetokenizer | None  # None: no tokenizer, no text
    matcher: StopStringMatcher
    stopped: bool = False  # a stop string matched: waiting for the scheduler's closing output
    usage: Usage | None = None  # from the first output: prompt and cached tokens
    completion_tokens: int = 0

    def push(self, tokens: list[int]) -> str:
        return self.decoder.push(tokens) if self.decoder is not None else ""

    def flush(self) -> str:
        return self.decoder.flush() if self.decoder is not None else ""


class Detokenization:
    """Per-request text state; ``process`` turns one step's outputs into text outputs."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestText] = {}

    def process(self, outputs: Sequence[TokenOutput]) -> tuple[list[TextOutput], list[StopStringHit]]:
        texts: list[TextOutput] = []
        hits: list[StopStringHit] = []
        for output in outputs:
            state = self.requests.get(output.rid)
            if state is None:
                state = self._start(output.text_params or TextParams())
                self.requests[output.rid] = state
            if state.stopped:
                if output.finish is not None:  # the scheduler's closing output: forget the request
                    del self.requests[output.rid]
                continue
            tokens = unpack_tokens(output.token_ids)
            state.completion_tokens += len(tokens)
            state.usage = output.usage or state.usage
            check = state.matcher.push(state.push(tokens))
            if check.matched is not None:
                finish = Finish(FinishReason.STOP, matched=check.matched)
                prompt = state.usage.prompt_tokens if state.usage else 0
                cached = state.usage.cached_tokens if state.usage else 0
                usage = Usage(prompt, state.completion_tokens, cached)
                texts.append(TextOutput(output.rid, check.text, output.token_ids, finish, usage, output.logprobs,
                                        output.produced_at))
                if output.finish is None:
                    state.stopped = True
                    hits.append(StopStringHit(output.rid, check.matched))
                else:
                    del self.requests[output.rid]
                continue
            text = check.text
            if output.finish is not None:
                text += state.matcher.push(state.flush()).text + state.matcher.flush()
                del self.requests[output.rid]
            texts.append(TextOutput(output.rid, text, output.token_ids, output.finish, output.usage, output.logprobs,
                                    output.produced_at))
        return texts, hits

    def _start(self, params: TextParams) -> _RequestText:
        decoder = None
        if self.tokenizer is not None:
            decoder = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                context_ids=unpack_tokens(params.prompt_tail),
            )
        return _RequestText(decoder, StopStringMatcher(params.stop))
