"""Offline generation: the server's scheduler loop in-process, with no actors around it.

    from app.engine import Engine
    engine = Engine()                       # the embedded tiny model
    [result] = engine.generate("Hello", SamplingParams(max_new_tokens=16, temperature=0))
    Engine(path, max_total_tokens=8192, kernel_options="fused-mlp=off")   # the server's engine flags

Text comes from the detokenizer actor's own code (app.text.detokenization: incremental
decoding, stop strings trimmed and reported), so offline and served results agree.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.engine.builder import BuiltEngine, build_scheduler
from app.engine.config import EngineConfig
from app.engine.kernel_plan import KernelOptions
from app.engine.request import Request
from app.engine.sampling import request_seed
from app.engine.scheduling import QueueFullError
from app.ipc.messages import SamplingParams, TextOutput, TokenLogprob, Usage, unpack_logprobs, unpack_tokens
from app.text.detokenization import Detokenization
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
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    result: GenerationResult | None = None


class Engine:
    """Load a model once; generate for batches of prompts with the continuous-batching scheduler."""

    def __init__(self, model_path: str | None = None, *, kernel_options: str | KernelOptions = "",
                 **engine_args: Any) -> None:
        """``engine_args``: EngineConfig's fields (the server's engine flags); ``kernel_options``
        as --kernel-options takes them, or a KernelOptions. Raises ValueError naming the flag or
        option at fault."""
        if model_path is None:
            from app.engine.make_checkpoint import default_model_dir

            model_path = str(default_model_dir())
        if isinstance(kernel_options, KernelOptions):
            kernel_options = kernel_options.spec()
        self.config = EngineConfig(model_path=model_path, kernel_options=kernel_options, **engine_args)
        # A checkpoint without tokenizer files still serves token ids (tests, benchmarks).
        self.tokenizer = Tokenizer.from_dir(model_path) if (Path(model_path) / "tokenizer.json").is_file() else None
        self.built: BuiltEngine = build_scheduler(self.config, self.tokenizer)
        self.scheduler = self.built.scheduler
        # The detokenizer actor's own logic, so offline text equals served text by construction.
        self.detokenization = Detokenization(self.tokenizer)
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
        requests = [self._request(tokens, params) for tokens, params in zip(token_lists, params_list)]
        self._check_admission(requests)
        rids = [req.rid for req in requests]
        progress = {req.rid: _Progress(req.params) for req in requests}
        for req in requests:
            self.scheduler.add_request(req)
        with torch.inference_mode():
            while any(progress[rid].result is None for rid in rids):
                texts, hits = self.detokenization.process(self.scheduler.step())
                for hit in hits:
                    self.scheduler.finish_by_stop_string(hit.rid, hit.stop)
                for output in texts:
                    self._collect(progress[output.rid], output)
        return [progress[rid].result for rid in rids]  # type: ignore[misc]

    def _request(self, tokens: list[int], params: SamplingParams) -> Request:
        """One validated request with a fresh id (ValueError naming the field at fault)."""
        params.validate(vocab_size=self.built.model_config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this checkpoint has none")
        rid = f"offline-{self._next_id}"
        self._next_id += 1
        return Request(rid, tokens, params, request_seed(params), arrival_time=time.time(),
                       priority=self.config.default_priority_value)

    def _check_admission(self, requests: list[Request]) -> None:
        """Raise what the scheduler would for any of ``requests`` before queueing one of them, so
        that a refused call leaves nothing queued behind (AdmissionError; QueueFullError when
        the call holds more prompts than --max-queued-requests lets wait)."""
        for req in requests:
            self.scheduler.waiting.check(req)
        bound = self.config.max_queued_requests
        if bound is not None and len(self.scheduler.waiting) + len(requests) > bound:
            raise QueueFullError()

    def _params_for(self, given: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if given is None:
            return [SamplingParams()] * n
        if isinstance(given, SamplingParams):
            return [given] * n
        if len(given) != n:
            raise ValueError(f"{n} prompts but {len(given)} sampling params")
        return list(given)

    def _collect(self, state: _Progress, output: TextOutput) -> None:
        """Add one text output to its request's result; the final one completes it."""
        tokens = unpack_tokens(output.token_ids)
        state.token_ids.extend(tokens)
        state.text.append(output.text)
        state.logprobs.extend(unpack_logprobs(tokens, output.logprobs))
        finish = output.finish
        if finish is None:
            return
        usage = output.usage or Usage(0, 0)
        params = state.params
        state.result = GenerationResult(
            text="".join(state.text),
            token_ids=state.token_ids,
            finish_reason=finish.reason.value,
            matched=finish.matched,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=len(state.token_ids),
            cached_tokens=usage.cached_tokens,
            logprobs=[lp.logprob for lp in state.logprobs] if params.logprobs else None,
            top_logprobs=[lp.top for lp in state.logprobs] if params.logprobs and params.top_logprobs else None,
        )
