"""The scheduler's step, kept alive through the errors the engine recovers from.

A step that runs out of device memory (``torch.cuda.OutOfMemoryError``: a long prompt's
activations, fragmentation, another process on the GPU) leaves the server sound: the memory the
step allocated is given back (pipeline.py), and nothing else half-changed. So instead of
failing the server, the requests of the step (every request prefilling or decoding: a step may
have touched any of them) end with a 503 that says what happened, the waiting queue stays, the
allocator's cache is emptied, the event is logged and counted (``app:num_step_errors_total``,
label ``kind``), and the next step runs. Any other exception still fails the scheduler, and the
server with it: its state can no longer be trusted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.ipc.messages import TokenOutput
from app.observability.logs import get_logger

OUT_OF_MEMORY_MESSAGE = ("The server ran out of GPU memory during a step (torch.cuda.OutOfMemoryError) and stopped "
                         "this request; the server goes on. Retry, or send a shorter request.")
OUT_OF_MEMORY_STATUS = 503


class StepRecovery:
    """Calls ``step`` (the scheduler's, or a faulty wrapper of it: app/actors/faults.py); on an
    out-of-memory error ends the requests of the step and returns their outputs instead."""

    def __init__(self, scheduler: Any, step: Callable[[], list[TokenOutput]]) -> None:
        import torch  # the scheduler actor has set its threads before building this

        self.scheduler = scheduler
        self.step = step
        self._torch = torch
        self.failures: dict[str, int] = {}  # steps failed and recovered, by kind
        self.on_failure: list[Callable[[str], None]] = []  # told the kind of each (metrics)
        self.log = get_logger()

    def __call__(self) -> list[TokenOutput]:
        try:
            return self.step()
        except self._torch.cuda.OutOfMemoryError as exc:
            return self.recover("oom", exc, OUT_OF_MEMORY_MESSAGE, OUT_OF_MEMORY_STATUS)

    def recover(self, kind: str, exc: BaseException, message: str, status_code: int) -> list[TokenOutput]:
        """End the requests of the failed step with ``message``; their final outputs."""
        ended = self.scheduler.fail_admitted(message, status_code)
        if self._torch.cuda.is_available():
            self._torch.cuda.empty_cache()  # the failed step's blocks back to the device
        self.failures[kind] = self.failures.get(kind, 0) + 1
        self.log.error("a step failed and its requests were ended; serving goes on", kind=kind,
                       error=f"{type(exc).__name__}: {str(exc)[:300]}", requests=[req.rid for req in ended][:32],
                       ended=len(ended), waiting=len(self.scheduler.waiting))
        for hook in self.on_failure:
            hook(kind)
        return self.scheduler.outputs.take()
