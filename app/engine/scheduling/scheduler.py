"""Continuous batching: the step, and the request table that knows where every request is.

A step reads: schedule → run → process. A prefill (EXTEND) step admits waiting requests within
the step's budget, chunking long prompts (prefill.py); otherwise a DECODE step runs every
request that is generating (running.py), retracting some when KV runs short (retraction.py).
The pipeline runs the step on the device and reads its tokens back (pipeline.py); processing
appends them to the requests, finishes those that stopped and reports outputs (reporting.py).
Finished requests leave at once: their KV goes to the prefix cache.

With overlap (the default on a GPU) a step is left in flight, and the next call queues the
step after it before reading its tokens whenever that step does not depend on them
(run_ahead.py), so the host's work hides behind the device's.

The scheduler actor and the offline Engine drive the same object: ``add_request``, ``abort``,
``finish_by_stop_string`` (the detokenizer's hook), ``refuse`` and ``step()``, which returns
the TokenOutput messages of the step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import structlog
import torch

from app.engine.forward_batch import ForwardMode
from app.engine.kv_swap import HostKVSwap
from app.engine.memory import KVMemory, PoolUsage
from app.engine.request import Request, Status
from app.engine.scheduling.batch import ScheduledBatch
from app.engine.scheduling.deadlines import Deadlines
from app.engine.scheduling.events import SchedulerEvents
from app.engine.scheduling.limits import SchedulerLimits
from app.engine.scheduling.pipeline import LaunchedStep, StepPipeline
from app.engine.scheduling.prefill import PrefillManager
from app.engine.scheduling.reporting import OutputReporter
from app.engine.scheduling.reserve import AdmissionReserve
from app.engine.scheduling.retraction import Retraction
from app.engine.scheduling.run_ahead import RunAhead
from app.engine.scheduling.running import RunningBatch
from app.engine.scheduling.waiting import EVICTED_BY_PRIORITY, Priorities, WaitingQueue
from app.engine.step_results import StepTiming
from app.ipc.messages import Finish, FinishReason, TokenOutput

if TYPE_CHECKING:  # the model stays out of the scheduling managers' imports
    from app.engine.model_runner import ModelRunner

_log = structlog.get_logger("app.engine.scheduling")


class SchedulerStats(NamedTuple):
    running: int  # requests decoding
    prefilling: int  # requests with a partial prompt (0 or 1)
    waiting: int  # requests in the waiting queue
    usage: PoolUsage


class Scheduler:
    """Continuous batching over one model and one KV memory, as small managers (see the package doc)."""

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
        waiting_timeout: float | None = None,
        request_timeout: float | None = None,
    ) -> None:
        self.runner = runner
        self.memory = memory
        self.limits = limits
        self.requests: dict[str, Request] = {}  # every live request by rid
        self.waiting = WaitingQueue(context_len=limits.context_len, kv_capacity=memory.capacity,
                                    allow_auto_truncate=limits.allow_auto_truncate,
                                    max_queued=limits.max_queued_requests,
                                    priorities=Priorities(limits.priority_scheduling, limits.low_priority_values_first),
                                    policy=limits.schedule_policy)
        self.running = RunningBatch(vocab_size=vocab_size, eos_token_ids=eos_token_ids, record_kernel=runner.fused_greedy)
        self.pipeline = StepPipeline(runner, memory, self.running, copy_stream=copy_stream)
        pipeline = self.pipeline
        self.reserve = AdmissionReserve(limits.schedule_conservativeness, clock=lambda: pipeline.forward_steps)
        # --enable-kv-swap: preempted requests' KV waits in host memory (kv_swap.py)
        self.swap = HostKVSwap(memory, limits.host_kv_pool_tokens) if limits.host_kv_pool_tokens else None
        self.prefill = PrefillManager(limits, memory, self.waiting, self.reserve, self.swap)
        self.retraction = Retraction(memory, self.waiting, self.reserve,
                                     preemption_threshold=limits.preemption_threshold, swap=self.swap)
        self.preempting = limits.priority_scheduling  # a waiting request may preempt a running one
        self.run_ahead = RunAhead(
            enabled=overlap, limits=limits, memory=memory, waiting=self.waiting, prefill=self.prefill,
            running=self.running, retraction=self.retraction,
        )
        self.outputs = OutputReporter()
        self.deadlines = Deadlines(waiting_timeout=waiting_timeout, request_timeout=request_timeout)
        self.events = SchedulerEvents()  # the observers of admissions, batches, first tokens, finishes

    @property
    def events(self) -> SchedulerEvents:
        """Who is told what happens (events.py); set it to an EventFanOut for several."""
        return self._events

    @events.setter
    def events(self, events: SchedulerEvents) -> None:
        self._events = events
        self.prefill.events = events
        self.retraction.events = events

    # ------------------------------------------------------------------ requests in

    def add_request(self, req: Request) -> None:
        """Queue a request. Raises AdmissionError for one that can never run, QueueFullError
        when the queue is full (with priorities: unless it evicts a less important one), ValueError for a
        duplicate rid. A request with nothing to generate finishes at once."""
        if req.rid in self.requests:
            raise ValueError(f"duplicate request id {req.rid!r}")
        evicted = self.waiting.check(req)  # a full queue's least important, when req outranks it
        if evicted is not None:
            self._finish(evicted, Finish(FinishReason.ABORT, message=EVICTED_BY_PRIORITY, status_code=503))
        req.max_len = self.limits.context_len
        self.requests[req.rid] = req
        if req.params.max_new_tokens == 0:
            self._finish(req, Finish(FinishReason.LENGTH))
            return
        self.waiting.push(req)
        self.deadlines.track(req)

    def abort(self, rid: str | None, message: str = "aborted", status_code: int = 499) -> int:
        """Abort one request (or every one when ``rid`` is None); returns how many ended."""
        targets = list(self.requests.values()) if rid is None else [self.requests[rid]] if rid in self.requests else []
        for req in targets:
            self._finish(req, Finish(FinishReason.ABORT, message=message, status_code=status_code))
        return len(targets)

    def expire_timeouts(self) -> int:
        """Abort (503) every request past its waiting or request timeout (deadlines.py); returns
        how many ended. The step calls it when the nearest deadline has passed; the scheduler
        actor also calls it when it is idle and a deadline comes."""
        expired = self.deadlines.expired(time.time())
        for req, message in expired:
            self._finish(req, Finish(FinishReason.ABORT, message=message, status_code=503))
        return len(expired)

    def finish_by_stop_string(self, rid: str, stop: str) -> None:
        """The detokenizer matched a stop string: end the request. Its final output (which
        the detokenizer expects and drops) says so; a request already finished is left alone."""
        req = self.requests.get(rid)
        if req is not None:
            self._finish(req, Finish(FinishReason.STOP, matched=stop))

    def refuse(self, rid: str, message: str, status_code: int) -> None:
        """Answer a request that could not be queued with an error finish, sent with the next
        step's outputs (``has_work`` is true until then)."""
        self.outputs.refuse(rid, message, status_code)

    # ------------------------------------------------------------------ the step

    def has_work(self) -> bool:
        """Whether step() has anything to do: a step in flight, a prompt to compute, a request
        decoding, or outputs to hand out."""
        return bool(
            self.pipeline.in_flight
            or self.waiting
            or self.running.active()
            or self.prefill.partial
            or self.outputs.pending
        )

    def step(self) -> list[TokenOutput]:
        """Run one step (if there is anything to run): schedule, run, process; return the
        outputs produced. With overlap, a step left in flight (every decode step, a prefill
        step with more to follow) is processed by the next call (see run_ahead.py)."""
        started = time.perf_counter()
        deadlines = self.deadlines.heap  # empty unless a timeout is set: one list read per step
        if deadlines and deadlines[0][0] <= time.time():
            self.expire_timeouts()
        with torch.inference_mode():
            previous = self.pipeline.take_in_flight()
            if previous is not None and (ahead := self.run_ahead.next_step(previous)) is not None:
                self.pipeline.in_flight = self.pipeline.launch(ahead)  # before ``previous``'s tokens are read
                self._events.batch_launched(ahead, self.pipeline.in_flight.launched_at)
                self.pipeline.timing.overlapped_steps += 1
                self._process(previous)
            else:
                if previous is not None:
                    self._process(previous)  # the schedule needs its tokens
                batch = self._schedule()
                if batch is not None:
                    launched = self.pipeline.launch(batch)
                    self._events.batch_launched(batch, launched.launched_at)
                    if self.run_ahead.keeps_in_flight(batch):
                        self.pipeline.in_flight = launched
                    else:
                        self._process(launched)
        work_left = self.has_work()
        if not work_left:
            self.memory.allocator.check()  # nothing in flight: reading the device costs nothing
        self.pipeline.timing.record_step(started, time.perf_counter(), work_left)
        return self.outputs.take()

    # ------------------------------------------------------------------ schedule

    def _schedule(self) -> ScheduledBatch | None:
        """From the host's up-to-date view: a prefill step if a prompt fits (with priorities,
        once the head of the queue has preempted a much less important running request, one a
        step: retraction.py), else a decode step."""
        self.running.flush_leavers()
        batch = self.prefill.schedule(self.running)
        if batch is None and self.preempting and self.retraction.preempt(self.running):
            batch = self.prefill.schedule(self.running)
        return batch or self._schedule_decode()

    def _schedule_decode(self) -> ScheduledBatch | None:
        """Every running request, one token each; those at the end of the context finish, and
        when KV is short some are retracted. A lone request that outgrows the whole pool ends
        with what it has (finish reason ``length``, a warning): output already produced is
        never lost."""
        running = self.running
        if not running.reqs:
            return None
        for req in list(running.reqs):  # no room for another token: the context is full
            if req.kv_len + 1 >= self.limits.context_len:
                self._finish(req, Finish(FinishReason.LENGTH))
        running.flush_leavers()
        if not running.reqs:
            return None
        if not self.retraction.make_room(running):  # the pool cannot hold even one sequence more
            req = running.reqs[0]
            _log.warning("a request outgrew the KV cache alone: it ends with finish reason length", rid=req.rid,
                         tokens=req.kv_len, generated=len(req.output_ids), kv_capacity=self.memory.capacity)
            self._finish(req, Finish(FinishReason.LENGTH))
            return None
        return running.decode_batch()

    # ------------------------------------------------------------------ process

    def _process(self, launched: LaunchedStep) -> None:
        """Wait for a launched step's tokens and apply them: chunks to the prefix cache, joiners
        to the running batch, each token to its request, which then finishes or reports."""
        sampled = self.pipeline.complete(launched)
        batch = launched.batch
        if batch.mode is ForwardMode.EXTEND:
            self.prefill.cache_chunks(batch)
        if sampled is None:
            self._events.batch_processed(batch, launched.launched_at, time.time())
            return
        sampling_reqs = [r for r, s in zip(batch.reqs, batch.samples) if s]
        if batch.mode is ForwardMode.EXTEND:
            self.running.join(sampling_reqs)
        tokens, stopped, capped = sampled.token_ids, sampled.stopped, sampled.length_capped
        chosen, top_ids, top_lps = sampled.logprobs, sampled.top_ids, sampled.top_logprobs
        report = self.outputs.report
        events, now = self._events, time.time()
        for i, req in enumerate(sampling_reqs):
            if req.status is Status.FINISHED:
                continue  # it ended while this step was in flight (overlap): the token is dropped
            req.output_ids.append(tokens[i])
            if len(req.output_ids) == 1:
                events.first_token(req, now)
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
                report(req)
        events.batch_processed(batch, launched.launched_at, time.time())

    def _finish(self, req: Request, finish: Finish) -> None:
        """End ``req`` wherever it is (queued, prefilling, running) and free what it holds."""
        if req.status is Status.RUNNING:
            self.running.leave(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.prefill.forget(req)
        if self.swap is not None:
            self.swap.discard(req)
        self.memory.release(req)
        req.status = Status.FINISHED
        req.finish = finish
        del self.requests[req.rid]
        self.outputs.report(req)
        self._events.finished(req, time.time())

    def fail_admitted(self, message: str, status_code: int) -> list[Request]:
        """After a step raised an error the engine recovers from (the device ran out of memory):
        drop the step in flight and end every request a step may have touched (prefilling or
        running) with an error finish, their memory given back; waiting requests stay queued.
        Returns the requests ended (their outputs go with the next ``outputs.take()``)."""
        self.pipeline.in_flight = None
        ended = [req for req in self.requests.values() if req.status is not Status.WAITING]
        for req in ended:
            self._finish(req, Finish(FinishReason.ABORT, message=message, status_code=status_code))
        self.running.flush_leavers()
        return ended

    # ------------------------------------------------------------------ introspection

    def live_requests(self) -> Iterable[Request]:
        return self.requests.values()

    def stats(self) -> SchedulerStats:
        self.memory.allocator.check()
        return SchedulerStats(
            running=self.running.active(),
            prefilling=int(self.prefill.partial is not None),
            waiting=len(self.waiting),
            usage=self.memory.usage(self.requests.values()),
        )

    @property
    def overlap(self) -> bool:
        """Whether steps run ahead of the previous step's tokens."""
        return self.run_ahead.enabled

    @property
    def prefilling(self) -> Request | None:
        """The request whose prompt is part-way in, if any."""
        return self.prefill.partial

    @property
    def forward_steps(self) -> int:
        return self.pipeline.forward_steps

    @property
    def retractions(self) -> int:
        """Decoding requests sent back to the queue for lack of KV."""
        return self.retraction.count

    @property
    def prefills_ahead(self) -> int:
        """Prefill steps queued behind a step in flight."""
        return self.run_ahead.prefills_ahead

    @property
    def timing(self) -> StepTiming:
        """Where the step time goes (step_results.py); a tool may set a fresh one to time a run."""
        return self.pipeline.timing

    @timing.setter
    def timing(self, timing: StepTiming) -> None:
        self.pipeline.timing = timing

    def copy_stream_for(self, rows: int) -> torch.cuda.Stream | None:
        """The stream a step sampling ``rows`` rows copies its tokens out on (pipeline.py)."""
        return self.pipeline.copy_stream_for(rows)
