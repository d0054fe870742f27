"""A step's sampled tokens on their way to the host, and how long the device spent on the step.

The host must read every step's tokens (to stream them, to see stops), but reading them the
usual way (``tensor.tolist()``) waits for *everything* queued on the device, including a step
queued after this one, which would undo the overlap of scheduling with the GPU. So the copies
start at once, non-blocking, into pinned host memory, and an event recorded right after them
marks the point to wait for::

    device stream:  [forward N][sample N][copy N → host] ●event N  [forward N+1][sample N+1] ...
    host:           queue N ─────────── queue N+1 ── wait(event N) ── process N ── queue N+2
                                                      (returns while N+1 still runs)

With ``copy-stream`` the copies run on a side stream that first waits for the step's
kernels, so that the next step's kernels (queued on the main stream right behind) do not wait
for the copy engine to take and finish them::

    main stream:    [forward N][sample N] [forward N+1][sample N+1] ...
    copy stream:                ⌞wait⌟ [copy N → host] ●event N

The copied device tensors are marked as used by the side stream (``record_stream``), so that
the allocator does not hand their memory out again before the copies are done.

On a CPU device every copy is already done when it returns and there is no event.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from app.engine.sampling import SampleOutput


class HostSample(NamedTuple):
    """A step's sampled results as Python lists (one entry per sampling row)."""

    token_ids: list[int]
    stopped: list[bool]
    length_capped: list[bool]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    # From a CUDA tensor, ``non_blocking`` makes torch allocate the destination in (cached)
    # pinned memory, so the copy is truly asynchronous.
    return None if t is None else t.to("cpu", non_blocking=True)


class PendingSample:
    """The copies of one step's :class:`SampleOutput` to the host, started but not waited for."""

    def __init__(self, sampled: SampleOutput, started: torch.cuda.Event | None = None,
                 copy_stream: torch.cuda.Stream | None = None) -> None:
        # One copy for the three per-row integers instead of three (the record kernel packed them).
        packed = sampled.packed
        if packed is None:
            packed = torch.stack((sampled.token_ids, sampled.stopped.long(), sampled.length_capped.long()))
        sources = (packed, sampled.logprobs, sampled.top_ids, sampled.top_logprobs)
        self._started = started
        self._done: torch.cuda.Event | None = None
        on_cuda = packed.device.type == "cuda"
        side = copy_stream if on_cuda else None  # None: the current stream (torch.cuda.stream(None) is a no-op)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(packed.device))
            for tensor in sources:
                if tensor is not None:
                    tensor.record_stream(side)
        with torch.cuda.stream(side):
            self._packed, self._logprobs, self._top_ids, self._top_logprobs = map(_to_host, sources)
            if on_cuda:
                self._done = torch.cuda.Event(enable_timing=started is not None)
                self._done.record()

    def wait(self) -> HostSample:
        """Block until the copies have landed (not until the device is idle); the lists."""
        if self._done is not None:
            self._done.synchronize()
        assert self._packed is not None
        tokens, stopped, capped = self._packed.tolist()
        return HostSample(
            tokens,
            [bool(s) for s in stopped],
            [bool(c) for c in capped],
            self._logprobs.tolist() if self._logprobs is not None else None,
            self._top_ids.tolist() if self._top_ids is not None else None,
            self._top_logprobs.tolist() if self._top_logprobs is not None else None,
        )

    def device_seconds(self) -> float | None:
        """Device time from the step's start event to its results (after :meth:`wait`); None
        without events (CPU, or no start event)."""
        if self._started is None or self._done is None:
            return None
        return self._started.elapsed_time(self._done) / 1000.0


class StepTiming:
    """Where the scheduler's time goes, summed over steps: the share of the time with work in
    which the device is busy is ``device_s / active_s`` (what the actor design must keep close
    to 1)."""

    def __init__(self) -> None:
        self.steps = 0
        self.step_s = 0.0  # wall time inside Scheduler.step()
        # Wall time while the scheduler had work: every step, and the gap before the next one
        # when work remained (with overlap the device runs between step() calls, so the share
        # of this time the device is busy is the figure that counts everything the host does).
        self.active_s = 0.0
        self._last_end: float | None = None  # set while work was left at the last step's end
        self.device_s = 0.0  # device time of the steps' forward + sampling (CUDA events)
        self.wait_s = 0.0  # host time blocked waiting for a step's tokens
        self.overlapped_steps = 0  # steps queued before the previous step's tokens were read

    def record_step(self, started: float, ended: float, work_left: bool) -> None:
        """Count one Scheduler.step() call from ``started`` to ``ended`` (perf_counter seconds)."""
        self.steps += 1
        self.step_s += ended - started
        self.active_s += ended - started
        if self._last_end is not None:  # the gap since the last step, which left work
            self.active_s += started - self._last_end
        self._last_end = ended if work_left else None

    def as_dict(self) -> dict[str, float | int]:
        return {
            "steps": self.steps,
            "step_s": round(self.step_s, 4),
            "active_s": round(self.active_s, 4),
            "device_s": round(self.device_s, 4),
            "wait_s": round(self.wait_s, 4),
            "overlapped_steps": self.overlapped_steps,
            "device_busy_share": round(self.device_s / self.active_s, 4) if self.active_s else 0.0,
        }
