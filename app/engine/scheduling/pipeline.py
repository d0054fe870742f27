"""The device side of a step: launch it (forward, sample, start copying its tokens to the
host) and complete it (wait for those tokens); with overlap, the one step left in flight.

Launching never waits for the device; completing waits for the step's own copies only, not
for a step queued behind it (step_results.py draws the streams). With overlap the scheduler
launches step N+1 before it completes step N, so the host's work on N+1 runs while the device
still computes N; run_ahead.py decides when that is allowed.

The copy stream (``copy-stream``): a step that samples at most ``copy_stream_max_rows``
rows copies its tokens out on a side stream, so that the next step's kernels do not queue
behind the copy; 0: none does. It must only ever copy: a side stream that runs a kernel slows
every decode step's CUDA graph, one that only copies costs nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from app.engine.forward_batch import ForwardMode
from app.engine.memory import KVMemory
from app.engine.sampling import SampleOutput
from app.engine.scheduling.batch import ScheduledBatch
from app.engine.scheduling.running import RunningBatch
from app.engine.step_results import HostSample, PendingSample, StepTiming

if TYPE_CHECKING:  # the model stays out of the scheduling managers' imports
    from app.engine.model_runner import ModelRunner


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device whose sampled tokens the host has not read yet."""

    batch: ScheduledBatch
    results: PendingSample | None  # None: nobody sampled (a prefill chunk)
    batch_tokens: torch.Tensor | None  # the sampled ids on the device, in batch order
    host_s: float = 0.0  # off CUDA: the (synchronous) forward and sampling time
    launched_at: float = 0.0  # time.time() when its launch began (for the scheduler's events)


class StepPipeline:
    """Runs scheduled steps on the model and reads their tokens back; counts and times them."""

    def __init__(self, runner: ModelRunner, memory: KVMemory, running: RunningBatch, *, copy_stream: int = 0) -> None:
        self.runner = runner
        self.memory = memory
        self.running = running  # owns the sampling rows that a step samples with
        self.copy_stream_max_rows = copy_stream
        self._copy_stream = torch.cuda.Stream(runner.device) if copy_stream > 0 else None
        self.in_flight: LaunchedStep | None = None  # with overlap: the step launched, not completed
        self.forward_steps = 0
        self.timing = StepTiming()
        # Device time per step needs CUDA events; on a CPU the device time is the step's.
        self._timed = runner.device.type == "cuda"

    def take_in_flight(self) -> LaunchedStep | None:
        """The step in flight, which the caller now completes (or has queued a step behind)."""
        launched, self.in_flight = self.in_flight, None
        return launched

    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queue the step's forward and sampling on the device and start copying its tokens
        to the host; nothing here waits for the device."""
        started = None
        if self._timed:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        began, launched_at = time.perf_counter(), time.time()  # off CUDA the forward runs in launch
        logits = self._forward(batch)
        sampled = self._sample(batch, logits)
        results = None
        if sampled is not None:
            results = PendingSample(sampled, started, self.copy_stream_for(sampled.token_ids.shape[0]))
        host_s = 0.0 if self._timed else time.perf_counter() - began
        return LaunchedStep(batch, results, sampled.token_ids if sampled is not None else None, host_s, launched_at)

    def copy_stream_for(self, rows: int) -> torch.cuda.Stream | None:
        """The stream that a step sampling ``rows`` rows copies its tokens out on: the side
        stream up to ``copy-stream``'s limit, else None (the current stream)."""
        return self._copy_stream if rows <= self.copy_stream_max_rows else None

    def complete(self, launched: LaunchedStep) -> HostSample | None:
        """Wait for a launched step's tokens; None when it sampled nothing."""
        if launched.results is None:
            return None
        waited = time.perf_counter()
        host = launched.results.wait()
        self.timing.wait_s += time.perf_counter() - waited
        device_s = launched.results.device_seconds()
        self.timing.device_s += device_s if device_s is not None else launched.host_s
        return host

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Allocate the step's KV slots and run the model; the input ids from the batch (on the
        device) when the host does not know them yet (a step run ahead), else from the
        requests' tokens."""
        slots = self.memory.alloc_for(batch.reqs, batch.extend_lens)
        if slots is None:
            # The budget counted evictable slots that a lock taken in this very step pinned.
            raise MemoryError("KV pool exhausted although the step was budgeted; this is a bug")
        input_ids = batch.input_ids
        ids: list[int] | torch.Tensor = [] if input_ids is None else input_ids
        prefix_lens: list[int] = []
        for req, n in zip(batch.reqs, batch.extend_lens):
            if input_ids is None:
                ids.extend(req.fill_slice(req.kv_len, req.kv_len + n))  # type: ignore[union-attr]
            prefix_lens.append(req.kv_len)
        rows = [req.row for req in batch.reqs]
        try:
            logits = self.runner.forward(batch.mode, rows, prefix_lens, batch.extend_lens,
                                         ids, slots)  # type: ignore[arg-type]
        except BaseException:
            self.memory.give_back(batch.reqs, batch.extend_lens, slots)  # no request holds them yet
            raise
        for req, n in zip(batch.reqs, batch.extend_lens):
            req.kv_len += n
        self.forward_steps += 1
        return logits

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> SampleOutput | None:
        if batch.mode is ForwardMode.DECODE:
            return self.running.sample_decode(logits, self.runner.argmax_keys_for(batch.mode, len(batch.reqs)))
        return self.running.sample_joiners(batch, logits)
