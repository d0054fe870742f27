"""The detokenizer actor: token ids in, text out; applies stop strings.

Per request it keeps an incremental decoder (a multi-byte character split across tokens is
held until complete) and a stop-string matcher (text that could still become a stop string is
held back). When a stop string matches, the request's final text goes to the ingress at once,
the scheduler is told to end the request, and the one closing output the scheduler then
sends for it is dropped. At a normal finish, everything held back is flushed, so streamed and
non-streamed text are identical.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from app.actors.child import ReadyCallback, run_actor
from app.actors.endpoints import Endpoints
from app.ipc.batching import batches_under, text_output_size
from app.ipc.messages import (
    ControlReply,
    Finish,
    FinishReason,
    StepOutput,
    StopStringHit,
    TextBatch,
    TextOutput,
    TextParams,
    TokenOutput,
    Usage,
    unpack_tokens,
)
from app.observability.logs import get_logger
from app.text.incremental_detokenize import IncrementalDetokenizer
from app.text.stop_strings import StopStringMatcher
from app.text.tokenizer import Tokenizer


@dataclass
class _RequestText:
    decoder: IncrementalDetokenizer
    matcher: StopStringMatcher
    stopped: bool = False  # a stop string matched: waiting for the scheduler's closing output
    usage: Usage | None = None  # from the first output: prompt and cached tokens
    completion_tokens: int = 0


class Detokenization:
    """Per-request text state; ``process`` turns one step's outputs into text outputs."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestText] = {}

    def process(self, outputs: tuple[TokenOutput, ...]) -> tuple[list[TextOutput], list[StopStringHit]]:
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
            check = state.matcher.push(state.decoder.push(tokens))
            if check.matched is not None:
                finish = Finish(FinishReason.STOP, matched=check.matched)
                prompt = state.usage.prompt_tokens if state.usage else 0
                cached = state.usage.cached_tokens if state.usage else 0
                usage = Usage(prompt, state.completion_tokens, cached)
                texts.append(TextOutput(output.rid, check.text, output.token_ids, finish, usage, output.logprobs, output.produced_at))
                if output.finish is None:
                    state.stopped = True
                    hits.append(StopStringHit(output.rid, check.matched))
                else:
                    del self.requests[output.rid]
                continue
            text = check.text
            if output.finish is not None:
                text += state.matcher.push(state.decoder.flush()).text + state.matcher.flush()
                del self.requests[output.rid]
            texts.append(TextOutput(output.rid, text, output.token_ids, output.finish, output.usage, output.logprobs, output.produced_at))
        return texts, hits

    def _start(self, params: TextParams) -> _RequestText:
        decoder = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=params.skip_special_tokens, context_ids=unpack_tokens(params.prompt_tail)
        )
        return _RequestText(decoder, StopStringMatcher(params.stop))


async def detokenizer_main(config: dict[str, Any], ready: ReadyCallback) -> None:
    log = get_logger()
    detokenize = Detokenization(Tokenizer.from_dir(config["model_path"]))
    with Endpoints("detokenizer", config["channels"]) as channels:
        inbox = channels.receivers["to_detokenizer"]
        to_ingress = channels.senders["detokenizer_to_ingress"]
        to_scheduler = channels.senders["detokenizer_to_scheduler"]
        ready({})
        async for message in inbox:
            if isinstance(message, StepOutput):
                texts, hits = detokenize.process(message.outputs)
                for part in batches_under(texts, text_output_size, to_ingress.max_message_bytes // 2):
                    await to_ingress.send(TextBatch(tuple(part)))
                for hit in hits:
                    await to_scheduler.send(hit)
            elif isinstance(message, ControlReply):
                await to_ingress.send(message)
        log.info("scheduler closed its channel: stopping")


def main() -> None:
    run_actor(sys.argv[-1].removeprefix("app::"), detokenizer_main)


if __name__ == "__main__":
    main()
