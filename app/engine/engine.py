"""Offline generation: the server's scheduler loop in-process, with no actors around it.

    from app.engine import Engine
    engine = Engine()                       # the embedded tiny model
    [result] = engine.generate("Hello", SamplingParams(max_new_tokens=16, temperature=0))

Text is produced the way the detokenizer actor produces it (incremental decoding, stop
strings trimmed and reported), so offline and served results agree.
"""

from __future__ import annotations

import time
from pathlib import Path
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from app.engine.builder import BuiltEngine, build_scheduler
from app.engine.config import EngineConfig
from app.engine.request import Request
from app.engine.sampling import request_seed
from app.ipc.messages import FinishReason, SamplingParams, TokenOutput, unpack_tokens
from app.text.incremental_detokenize import IncrementalDetokenizer
from app.text.stop_strings import StopStringMatcher
from app.text.tokenizer import Tokenizer


@dataclass
class GenerationResult:
    """One request's result. ``logprobs`` are of the raw model distribution (before
    temperature and penalties), one per output token, when asked for."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "abort"
    matched: str | int | None  # the stop string or stop token that ended it
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class _Progress:
    """What the engine has collected for one request so far."""

    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None  # None: the checkpoint has no tokenizer
    matcher: StopStringMatcher
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    result: GenerationResult | None = None


class Engine:
    """Load a model once; generate for batches of prompts with the continuous-batching scheduler."""

    def __init__(self, model_path: str | None = None, **engine_args: Any) -> None:
        if model_path is None:
            from app.engine.make_checkpoint import default_model_dir

            model_path = str(default_model_dir())
        self.config = EngineConfig(model_path=model_path, **engine_args)
        # A checkpoint without tokenizer files still serves token ids (tests, benchmarks).
        self.tokenizer = Tokenizer.from_dir(model_path) if (Path(model_path) / "tokenizer.json").is_file() else None
        self.built: BuiltEngine = build_scheduler(self.config, self.tokenizer)
        self.scheduler = self.built.scheduler
        self._next_id = 0

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        input_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text, or token ids through ``input_ids``) at once, in one
        continuous batch; results come back in the order of the prompts.

        Raises ValueError for invalid sampling parameters or a prompt the engine cannot serve.
        """
        if (prompts is None) == (input_ids is None):
            raise ValueError("give either prompts or input_ids")
        if input_ids is None:
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model_path} has no tokenizer.json: pass input_ids")
            texts = [prompts] if isinstance(prompts, str) else list(prompts or [])
            token_lists = [self.tokenizer.encode(t) for t in texts]
        else:
            token_lists = [list(ids) for ids in input_ids]
        params_list = self._params_for(sampling_params, len(token_lists))
        rids: list[str] = []
        progress: dict[str, _Progress] = {}
        for tokens, params in zip(token_lists, params_list):
            params.validate(vocab_size=self.built.model_config.vocab_size)
            if params.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this checkpoint has none")
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            req = Request(rid, tokens, params, request_seed(params), arrival_time=time.time())
            progress[rid] = _Progress(params, self._detokenizer(params, tokens), StopStringMatcher(params.stop))
            self.scheduler.add_request(req)
            rids.append(rid)
        with torch.inference_mode():
            while any(progress[rid].result is None for rid in rids):
                for output in self.scheduler.step():
                    state = progress.get(output.rid)
                    if state is not None:  # else: the closing output of an earlier stop-string match
                        self._collect(state, output)
        return [progress[rid].result for rid in rids]  # type: ignore[misc]

    def _detokenizer(self, params: SamplingParams, prompt: list[int]) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens, context_ids=prompt[-5:])

    def _params_for(self, given: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if given is None:
            return [SamplingParams()] * n
        if isinstance(given, SamplingParams):
            return [given] * n
        if len(given) != n:
            raise ValueError(f"{n} prompts but {len(given)} sampling params")
        return list(given)

    def _collect(self, state: _Progress, output: TokenOutput) -> None:
        """Apply one output the way the detokenizer would: text deltas, stop strings, finish."""
        if state.result is not None:
            return  # outputs after a stop-string match are dropped
        tokens = unpack_tokens(output.token_ids)
        state.token_ids.extend(tokens)
        if output.usage is not None:
            state.prompt_tokens, state.cached_tokens = output.usage.prompt_tokens, output.usage.cached_tokens
        if output.logprobs is not None:
            chosen = array("f")
            chosen.frombytes(output.logprobs.chosen)
            state.logprobs.extend(chosen)
            k = output.logprobs.k
            if k:
                ids = unpack_tokens(output.logprobs.top_ids)
                lps = array("f")
                lps.frombytes(output.logprobs.top_logprobs)
                state.top.extend([list(zip(ids[i : i + k], lps[i : i + k])) for i in range(0, len(ids), k)])
        detok = state.detokenizer
        check = state.matcher.push(detok.push(tokens) if detok else "")
        state.text.append(check.text)
        finish = output.finish
        if check.matched is not None:
            self.scheduler.finish_by_stop_string(output.rid, check.matched)
            reason, matched = FinishReason.STOP, check.matched
        elif finish is not None:
            state.text.append(state.matcher.push(detok.flush() if detok else "").text)
            state.text.append(state.matcher.flush())
            reason, matched = finish.reason, finish.matched
        else:
            return
        state.result = GenerationResult(
            text="".join(state.text),
            token_ids=state.token_ids,
            finish_reason=reason.value,
            matched=matched,
            prompt_tokens=state.prompt_tokens,
            completion_tokens=len(state.token_ids),
            cached_tokens=state.cached_tokens,
            logprobs=state.logprobs if state.params.logprobs else None,
            top_logprobs=state.top if state.params.logprobs and state.params.top_logprobs else None,
        )
