"""Continuous batching: which requests run in each step, and what their results mean.

A step reads: schedule → forward → sample → process. A prefill (EXTEND) step admits waiting
requests within the token, KV and row budgets, chunking long prompts (one request at a time
carries a partial prompt into the next step); otherwise a DECODE step runs every request that
is generating. Finished requests leave at once: their KV goes to the prefix cache.

The scheduler actor and the offline Engine drive the same object: ``add_request``, ``abort``,
``finish_by_stop_string`` (the detokenizer's hook), and ``step()``, which returns the
TokenOutput messages of the step.

Overlap (``overlap=True``, the default on a GPU): a DECODE step's tokens are read one step
later, so that the host schedules and launches step N+1 while the device still runs step N::

    step() k:    complete(N-1)?  ─ schedule ─ launch N (forward + sample, queued) ─ return
    step() k+1:  launch N+1 with N's tokens as input ids, straight from the device;
                 then wait for N's tokens (the device is busy with N+1) and process them

Running ahead needs the next batch to be the same decode batch, less the requests that finished
or were aborted since (their rows are dropped, and step N's samples of the others gathered on
the device): nothing waiting, KV for one more token each. Otherwise step N is completed first
and the next step is scheduled from the host's up-to-date view, as without overlap.

Prefill steps run ahead too: while prompts wait, a prefill step stays in flight and the next
prefill step (prompt tokens only, all known on the host) is queued behind it, or behind the
decode step in flight when new prompts arrive, before that step's tokens are read; its budget
counts the in-flight step's requests as running. After the last prefill step, the decode step
of everyone (the running requests, then the prefill's joiners, whose first tokens are fed from
the device) is queued behind it in the same way. A request aborted while
its prefill is in flight joins the running batch as a leaver, so that its sampling row (added
at launch) goes with the next filter.
A request that finished at step N has already been queued for step N+1: that one extra token
is computed and dropped, and its KV slot goes back with the request's other slots. While a
step is in flight, a decoding request's ``kv_len`` counts the token being computed, so
``kv_len == len(fill_ids)`` between steps (instead of ``len(fill_ids) - 1``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from app.engine.forward_batch import ForwardMode
from app.engine.host_to_device import tensor_on
from app.engine.memory import KVMemory, PoolUsage
from app.engine.model_runner import ModelRunner
from app.engine.policy import PrefillBudget, WaitingQueue, retraction_order
from app.engine.request import Request, Status
from app.engine.sampling import SampleOutput, SamplingBatch
from app.engine.step_results import HostSample, PendingSample, StepTiming
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


class SchedulerLimits(NamedTuple):
    context_len: int  # longest sequence (prompt + output)
    max_prefill_tokens: int
    chunk_size: int | None  # None: no chunked prefill
    new_token_ratio: float
    stream_interval: int = 1  # report incremental outputs every N tokens (the first at once)


class AdmissionError(ValueError):
    """A request the engine can never serve (too long for the context or the KV pool)."""


@dataclass
class _Scheduled:
    """One step's batch: the requests, how many tokens each computes, and which sample."""

    mode: ForwardMode
    reqs: list[Request]
    extend_lens: list[int]
    samples: list[bool]  # per request: this step completes its prompt (or decodes): sample


@dataclass
class _Launched:
    """A step queued on the device whose sampled tokens the host has not read yet."""

    batch: _Scheduled
    results: PendingSample | None  # None: nobody sampled (a prefill chunk)
    batch_tokens: torch.Tensor | None  # the sampled ids on the device, in batch order
    host_s: float = 0.0  # off CUDA: the (synchronous) forward and sampling time


class SchedulerStats(NamedTuple):
    running: int
    prefilling: int
    waiting: int
    usage: PoolUsage


class Scheduler:
    """Owns the waiting queue and the running batch over one model and one KV memory."""

    def __init__(
        self,
        runner: ModelRunner,
        memory: KVMemory,
        limits: SchedulerLimits,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        overlap: bool = False,
        copy_stream: int = 0,
    ) -> None:
        self.runner = runner
        self.overlap = overlap
        # --copy-stream (resolve_copy_stream): a step that samples at most ``copy_stream_max_rows``
        # rows copies its tokens out on ``_copy_stream`` (see step_results.py); 0: none does. It
        # must only ever copy: a side stream that runs a kernel slows every decode step's graph
        # (docs/gpu_notes.md, variant 100), one that only copies costs nothing.
        self.copy_stream_max_rows = copy_stream
        self._copy_stream = torch.cuda.Stream(runner.device) if copy_stream > 0 else None
        self.memory = memory
        self.limits = limits
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # decoding, in the row order of ``sampling``
        # Requests that left ``running`` (finished, retracted) but whose rows are still in it and
        # in ``sampling``: removed together by _flush_leavers, one filter for all of them.
        self._leavers: set[Request] = set()
        self.sampling: SamplingBatch | None = None
        self.prefilling: Request | None = None  # the one request with a partial prompt
        self.requests: dict[str, Request] = {}  # every live request by rid
        self.pending: list[TokenOutput] = []  # outputs produced outside step() (aborts, ...)
        self.forward_steps = 0
        self.retractions = 0  # decoding requests sent back to the queue for lack of KV
        self.prefills_ahead = 0  # prefill steps queued behind a prefill step in flight
        self._launched: _Launched | None = None  # with overlap: the decode step in flight
        self.timing = StepTiming()
        # Device time per step needs CUDA events; on a CPU the device time is the step's.
        self._timed = runner.device.type == "cuda"

    # ------------------------------------------------------------------ requests in

    def add_request(self, req: Request) -> None:
        """Queue a request. Raises AdmissionError for one that can never run, ValueError for a
        duplicate rid. A request with nothing to generate finishes at once."""
        if req.rid in self.requests:
            raise ValueError(f"duplicate request id {req.rid!r}")
        prompt_len = len(req.prompt_ids)
        if prompt_len == 0:
            raise AdmissionError("the prompt is empty: at least one token is needed")
        if prompt_len >= self.limits.context_len:
            raise AdmissionError(
                f"The input ({prompt_len} tokens) is longer than the model's context length "
                f"({self.limits.context_len} tokens)."
            )
        if prompt_len + 1 > self.memory.capacity:
            raise AdmissionError(f"The input ({prompt_len} tokens) does not fit in the KV cache ({self.memory.capacity} tokens).")
        req.max_len = self.limits.context_len
        self.requests[req.rid] = req
        if req.params.max_new_tokens == 0:
            self._finish(req, Finish(FinishReason.LENGTH))
            return
        self.waiting.push(req)

    def abort(self, rid: str | None, message: str = "aborted", status_code: int = 499) -> int:
        """Abort one request (or every one when ``rid`` is None); returns how many ended."""
        targets = list(self.requests.values()) if rid is None else [self.requests[rid]] if rid in self.requests else []
        for req in targets:
            self._finish(req, Finish(FinishReason.ABORT, message=message, status_code=status_code))
        return len(targets)

    def finish_by_stop_string(self, rid: str, stop: str) -> None:
        """The detokenizer matched a stop string: end the request. Its final output (which
        the detokenizer expects and drops) says so; a request already finished is left alone."""
        req = self.requests.get(rid)
        if req is not None:
            self._finish(req, Finish(FinishReason.STOP, matched=stop))

    # ------------------------------------------------------------------ the step

    def has_work(self) -> bool:
        return bool(
            self._launched
            or self.waiting
            or len(self.running) > len(self._leavers)
            or self.prefilling
            or self.pending
        )

    def step(self) -> list[TokenOutput]:
        """Run one forward step (if there is anything to run); return the outputs produced.
        With overlap, a step left in flight (every decode step, a prefill step with more to
        follow) gives its outputs with the next call (see the module doc)."""
        started = time.perf_counter()
        with torch.inference_mode():
            launched, self._launched = self._launched, None
            # Prompts that fit go first; when none does (KV is short), decoding goes on ahead.
            if launched is not None and (ahead := self._prefill_ahead(launched)) is not None:
                self._launched = self._launch(ahead)
                self.timing.overlapped_steps += 1
                self.prefills_ahead += 1
                self._complete(launched)
            elif launched is not None and (ahead := self._decode_ahead(launched)) is not None:
                self._launched = self._launch(self._decode_batch(), input_ids=ahead)
                self.timing.overlapped_steps += 1
                self._complete(launched)
            elif launched is not None and (after := self._decode_after_prefill(launched)) is not None:
                batch, ids = after
                self._launched = self._launch(batch, input_ids=ids)
                self.timing.overlapped_steps += 1
                self._complete(launched)
            else:
                if launched is not None:
                    self._complete(launched)
                self._flush_leavers()
                batch = self._schedule()
                if batch is not None:
                    step = self._launch(batch)
                    if self._stays_in_flight(batch):
                        self._launched = step
                    else:
                        self._complete(step)
        work_left = self.has_work()
        if not work_left:
            self.memory.allocator.check()  # nothing in flight: reading the device costs nothing
        self.timing.record_step(started, time.perf_counter(), work_left)
        outputs, self.pending = self.pending, []
        return outputs

    def _decode_ahead(self, launched: _Launched) -> torch.Tensor | None:
        """When the step after ``launched`` is a decode step of the same requests, less those
        that left meanwhile (finished or aborted: they are dropped from the batch here), the
        device tensor of its input ids (``launched``'s samples of the staying rows), so that it
        can be queued before ``launched``'s tokens are known on the host; else None. Asked only
        when no prefill step could be scheduled ahead: prompts may wait (for KV to free up) and
        the running requests decode meanwhile, as the plain schedule would decode them."""
        if not self.overlap or launched.batch.mode is not ForwardMode.DECODE or launched.batch_tokens is None:
            return None
        reqs = launched.batch.reqs
        if len(reqs) != len(self.running) or any(a is not b for a, b in zip(reqs, self.running)):
            return None
        staying = [r for r in reqs if r not in self._leavers] if self._leavers else reqs
        if not staying or any(r.kv_len + 1 >= self.limits.context_len for r in staying):
            return None  # the normal path finishes them
        if self.memory.available() < self.memory.slots_needed(staying, [1] * len(staying)):
            return None
        tokens = launched.batch_tokens
        if len(staying) < len(reqs):
            keep = self._flush_leavers()  # running becomes ``staying``; their sampling rows, in order
            assert keep is not None
            tokens = tokens[tensor_on(keep, torch.int64, tokens.device)]
        return tokens

    def _stays_in_flight(self, batch: _Scheduled) -> bool:
        """With overlap, whether a step just launched is left running for the next step() to
        complete: every decode step, and a prefill step when a step can follow it without its
        tokens (more prompts: _prefill_ahead; the decode of its joiners: _decode_after_prefill)."""
        if not self.overlap:
            return False
        return batch.mode is ForwardMode.DECODE or any(batch.samples) or bool(self.waiting) or self.prefilling is not None

    def _prefill_ahead(self, launched: _Launched) -> _Scheduled | None:
        """With a step in flight, the next prefill step, scheduled before the launched step's
        tokens are read (a prefill's inputs are prompt tokens, all known on the host), or None.

        Behind a prefill step, its budget counts that step's joiners as running already; not
        while requests are leaving, since their sampling rows must go before new ones are added
        behind rows still in flight. Behind a decode step, its requests are running already
        (those that left keep their rows until the prefill is processed, then go together)."""
        if not self.overlap or (not self.waiting and self.prefilling is None):
            return None
        if launched.batch.mode is not ForwardMode.EXTEND:
            return self._schedule_prefill()
        if self._leavers:
            return None
        joiners = [r for r, s in zip(launched.batch.reqs, launched.batch.samples) if s]
        return self._schedule_prefill(in_flight=joiners)

    def _decode_after_prefill(self, launched: _Launched) -> tuple[_Scheduled, torch.Tensor] | None:
        """With the last prefill step in flight, the decode step after it: every running
        request, then the prefill's joiners (the order of their sampling rows), fed the running
        requests' last tokens from the host and the joiners' first tokens straight from the
        device; or None when that step is not certain (someone left, a prompt is part-way in,
        KV is short, or every joiner ends with its first token). Asked only when no further
        prefill step could be scheduled ahead (prompts that wait for KV wait as they would)."""
        if not self.overlap or launched.batch.mode is not ForwardMode.EXTEND or launched.batch_tokens is None:
            return None
        if self.prefilling is not None or self._leavers:
            return None
        joiners = launched.batch.reqs
        if not all(launched.batch.samples) or any(r.status is not Status.PREFILLING for r in joiners):
            return None  # a chunk still to come, or a joiner aborted while in flight
        if not self.running and all(r.params.max_new_tokens <= len(r.output_ids) + 1 for r in joiners):
            return None  # they all end with the prefill's token: nothing to decode
        reqs = [*self.running, *joiners]
        if any(r.kv_len + 1 >= self.limits.context_len for r in reqs):
            return None
        if self.memory.available() < self.memory.slots_needed(reqs, [1] * len(reqs)):
            return None
        device = launched.batch_tokens.device
        last = tensor_on([r.fill_slice(r.kv_len, r.kv_len + 1)[0] for r in self.running], torch.int64, device)
        ids = torch.cat([last, launched.batch_tokens.to(torch.int64)])
        return _Scheduled(ForwardMode.DECODE, reqs, [1] * len(reqs), [True] * len(reqs)), ids

    def _launch(self, batch: _Scheduled, input_ids: torch.Tensor | None = None) -> _Launched:
        """Queue the step's forward and sampling on the device and start copying its tokens
        to the host; nothing here waits for the device."""
        started = None
        if self._timed:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        began = time.perf_counter()
        logits = self._forward(batch, input_ids)
        sampled = self._sample(batch, logits)
        results = None
        if sampled is not None:
            results = PendingSample(sampled, started, self.copy_stream_for(sampled.token_ids.shape[0]))
        host_s = 0.0 if self._timed else time.perf_counter() - began
        return _Launched(batch, results, sampled.token_ids if sampled is not None else None, host_s)

    def copy_stream_for(self, rows: int) -> torch.cuda.Stream | None:
        """The stream that a step sampling ``rows`` rows copies its tokens out on: the side
        stream up to ``--copy-stream``'s limit, else None (the current stream)."""
        return self._copy_stream if rows <= self.copy_stream_max_rows else None

    def _complete(self, launched: _Launched) -> None:
        """Wait for a launched step's tokens and process them."""
        host = None
        if launched.results is not None:
            waited = time.perf_counter()
            host = launched.results.wait()
            self.timing.wait_s += time.perf_counter() - waited
            device_s = launched.results.device_seconds()
            self.timing.device_s += device_s if device_s is not None else launched.host_s
        self._process(launched.batch, host)

    # ------------------------------------------------------------------ schedule

    def _schedule(self) -> _Scheduled | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self, in_flight: Sequence[Request] = ()) -> _Scheduled | None:
        """The next prefill step, or None. ``in_flight``: requests whose prefill step has not
        been processed yet (they join the running batch then), budgeted as running."""
        if self.prefilling is None and not self.waiting:
            return None
        running = [*(r for r in self.running if r not in self._leavers), *in_flight]
        budget = PrefillBudget.for_step(
            max_prefill_tokens=self.limits.max_prefill_tokens,
            chunk_size=self.limits.chunk_size,
            available_kv=self.memory.available(),
            running=running,
            free_rows=self.memory.table.num_free(),
            new_token_ratio=self.limits.new_token_ratio,
            page_size=self.memory.page_size,
        )
        reqs: list[Request] = []
        lens: list[int] = []
        if self.prefilling is not None:
            n = budget.take(self.prefilling, needs_row=False, alone=not running)
            if n == 0:
                return None
            reqs.append(self.prefilling)
            lens.append(n)
            self.prefilling = None
        while self.waiting and (self.limits.chunk_size is None or budget.compute_tokens > 0):
            req = self.waiting.peek()
            assert req is not None
            evictable = self.memory.cache.evictable_size()
            if not self.memory.admit(req):
                break
            budget.kv_tokens -= evictable - self.memory.cache.evictable_size()  # now locked by req
            n = budget.take(req, needs_row=True, alone=not running and not reqs)
            if n == 0:
                self.memory.release(req)
                break
            self.waiting.pop()
            if req.times_retracted == 0 and req.kv_len and not req.output_ids:
                req.cached_tokens = req.kv_len
            req.status = Status.PREFILLING
            reqs.append(req)
            lens.append(n)
        if not reqs:
            return None
        samples = [r.kv_len + n == r.fill_len for r, n in zip(reqs, lens)]
        partial = [r for r, done in zip(reqs, samples) if not done]
        assert len(partial) <= 1, "at most one request carries a partial prompt"
        self.prefilling = partial[0] if partial else None
        return _Scheduled(ForwardMode.EXTEND, reqs, lens, samples)

    def _schedule_decode(self) -> _Scheduled | None:
        if not self.running:
            return None
        for req in list(self.running):  # no room for another token: the context is full
            if req.kv_len + 1 >= self.limits.context_len:
                self._finish(req, Finish(FinishReason.LENGTH))
        self._flush_leavers()
        if not self.running:
            return None
        victims = iter(retraction_order(self.running))
        while self.memory.available() < self.memory.slots_needed(self.running, [1] * len(self.running)):
            if len(self.running) == 1:  # the pool cannot hold even one sequence more
                self._finish(self.running[0], Finish(FinishReason.ABORT, message="the KV cache is full", status_code=503))
                return None
            self._retract(next(victims))
            self._flush_leavers()
        return self._decode_batch()

    def _decode_batch(self) -> _Scheduled:
        """Every running request, one token each."""
        n = len(self.running)
        return _Scheduled(ForwardMode.DECODE, list(self.running), [1] * n, [True] * n)

    def _retract(self, req: Request) -> None:
        """Give a decoding request's memory back and queue it to be recomputed (its KV goes to
        the prefix cache first, so the recomputation is free while it is not evicted)."""
        self._leave_running(req)
        self.memory.release(req)
        req.status = Status.WAITING
        req.times_retracted += 1
        self.retractions += 1
        self.waiting.push_front(req)

    # ------------------------------------------------------------------ forward and sample

    def _forward(self, batch: _Scheduled, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Allocate the step's KV slots and run the model; ``input_ids`` (on the device) when
        the host does not know them yet (decoding ahead), else from the requests' tokens."""
        slots = self.memory.alloc_for(batch.reqs, batch.extend_lens)
        if slots is None:
            # The budget counted evictable slots that a lock taken in this very step pinned;
            # give the step's prefill work back and retry next step.
            raise MemoryError("KV pool exhausted although the step was budgeted; this is a bug")
        ids: list[int] | torch.Tensor = [] if input_ids is None else input_ids
        prefix_lens: list[int] = []
        for req, n in zip(batch.reqs, batch.extend_lens):
            if input_ids is None:
                ids.extend(req.fill_slice(req.kv_len, req.kv_len + n))  # type: ignore[union-attr]
            prefix_lens.append(req.kv_len)
        rows = [req.row for req in batch.reqs]
        logits = self.runner.forward(batch.mode, rows, prefix_lens, batch.extend_lens, ids, slots)  # type: ignore[arg-type]
        for req, n in zip(batch.reqs, batch.extend_lens):
            req.kv_len += n
        self.forward_steps += 1
        return logits

    def _sample(self, batch: _Scheduled, logits: torch.Tensor) -> SampleOutput | None:
        if batch.mode is ForwardMode.DECODE:
            assert self.sampling is not None
            return self.sampling.sample(logits, self.runner.argmax_keys_for(batch.mode, len(batch.reqs)))
        picks = [i for i, s in enumerate(batch.samples) if s]
        if not picks:
            return None
        joiners = [batch.reqs[i] for i in picks]
        new = SamplingBatch.build(
            [r.params for r in joiners],
            [r.seed for r in joiners],
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            prompt_ids=[r.prompt_ids for r in joiners],
            output_ids=[r.output_ids for r in joiners],
            device=logits.device,
            record_kernel=self.runner.fused_greedy,
        )
        if len(picks) != len(batch.reqs):
            logits = logits[tensor_on(picks, torch.int64, logits.device)]
        sampled = new.sample(logits)
        if self.sampling is None:
            self.sampling = new
        else:
            self.sampling.merge(new)
        return sampled

    # ------------------------------------------------------------------ process

    def _process(self, batch: _Scheduled, sampled: HostSample | None) -> None:
        for req, done in zip(batch.reqs, batch.samples):
            if not done and req.status is Status.PREFILLING:
                self.memory.cache_progress(req)  # a chunk: share it, then go on next step
        if sampled is None:
            return
        sampling_reqs = [r for r, s in zip(batch.reqs, batch.samples) if s]
        if batch.mode is ForwardMode.EXTEND:
            for req in sampling_reqs:
                self.running.append(req)  # its sampling row was added when the step was launched
                if req.status is Status.FINISHED:  # aborted while its prefill was in flight
                    self._leave_running(req)
                else:
                    req.status = Status.RUNNING
        tokens, stopped, capped = sampled.token_ids, sampled.stopped, sampled.length_capped
        chosen, top_ids, top_lps = sampled.logprobs, sampled.top_ids, sampled.top_logprobs
        for i, req in enumerate(sampling_reqs):
            if req.status is Status.FINISHED:
                continue  # it ended while this step was in flight (overlap): the token is dropped
            req.output_ids.append(tokens[i])
            if req.params.logprobs and chosen is not None:
                req.pending_logprobs.append(chosen[i])
                k = req.params.top_logprobs
                if k and top_ids is not None and top_lps is not None:
                    req.pending_top_ids.append(top_ids[i][:k])
                    req.pending_top_logprobs.append(top_lps[i][:k])
            if stopped[i]:
                self._finish(req, Finish(FinishReason.STOP, matched=tokens[i]))
            elif capped[i] or req.fill_len >= self.limits.context_len:
                self._finish(req, Finish(FinishReason.LENGTH))
            elif req.reports_incrementally and (
                not req.reported or len(req.output_ids) - req.sent_tokens >= self.limits.stream_interval
            ):
                self._report(req)

    # ------------------------------------------------------------------ finishing and reporting

    def _leave_running(self, req: Request) -> None:
        """Mark ``req`` as gone from the decoding batch (see _flush_leavers)."""
        self._leavers.add(req)

    def _flush_leavers(self) -> list[int] | None:
        """Drop every request that left from ``running`` and its row from ``sampling``: one
        filter however many left (at the end of a batch, hundreds finish in one step). Returns
        the kept rows' old indices, or None when nobody left."""
        if not self._leavers:
            return None
        keep = [i for i, req in enumerate(self.running) if req not in self._leavers]
        self.running = [self.running[i] for i in keep]
        self._leavers.clear()
        if not keep:
            self.sampling = None
        else:
            assert self.sampling is not None
            self.sampling.filter(keep)
        return keep

    def _finish(self, req: Request, finish: Finish) -> None:
        """End ``req`` wherever it is (queued, prefilling, running) and free what it holds."""
        if req.status is Status.RUNNING:
            self._leave_running(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        if self.prefilling is req:
            self.prefilling = None
        self.memory.release(req)
        req.status = Status.FINISHED
        req.finish = finish
        del self.requests[req.rid]
        self._report(req)

    def _report(self, req: Request) -> None:
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
            text_params = TextParams(p.stop, p.skip_special_tokens, pack_tokens(req.prompt_ids[-5:]))
        self.pending.append(
            TokenOutput(req.rid, pack_tokens(new_tokens), req.finish, usage, logprobs, text_params, time.monotonic())
        )

    # ------------------------------------------------------------------ introspection

    def live_requests(self) -> Iterable[Request]:
        return self.requests.values()

    def stats(self) -> SchedulerStats:
        self.memory.allocator.check()
        return SchedulerStats(
            running=len(self.running) - len(self._leavers),
            prefilling=int(self.prefilling is not None),
            waiting=len(self.waiting),
            usage=self.memory.usage(self.requests.values()),
        )
