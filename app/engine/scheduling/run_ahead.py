"""Overlap: the next step that can be queued behind the step in flight before its tokens are
read, so that the host schedules and launches step N+1 while the device still runs step N::

    step() k:    complete(N-1)?  ─ schedule ─ launch N (forward + sample, queued) ─ return
    step() k+1:  launch N+1 with N's tokens as input ids, straight from the device;
                 then wait for N's tokens (the device is busy with N+1) and process them

Three steps can follow one in flight without its tokens, tried in this order:

- a prefill step (:meth:`RunAhead._prefill_ahead`): prompt tokens are all known on the host;
  behind a prefill step its budget counts that step's joiners as running;
- the same decode batch (:meth:`RunAhead._decode_ahead`), less the requests that finished or
  were aborted since: their rows are dropped, and the others' samples gathered on the device;
- after the last prefill step, the decode step of everyone
  (:meth:`RunAhead._decode_after_prefill`): the running requests, then the prefill's joiners,
  whose first tokens are fed from the device.

Otherwise the step in flight is completed first and the next one is scheduled from the host's
up-to-date view, as without overlap. A request that finished at step N has already been queued
for step N+1: that one extra token is computed and dropped, and its KV slot goes back with the
request's other slots. While a step is in flight, a decoding request's ``kv_len`` counts the
token being computed, so ``kv_len == len(fill_ids)`` between steps (instead of
``len(fill_ids) - 1``). A request aborted while its prefill is in flight joins the running
batch as a leaver, so that its sampling row (added at launch) goes with the next filter.
"""

from __future__ import annotations

import torch

from app.engine.forward_batch import ForwardMode
from app.engine.host_to_device import tensor_on
from app.engine.memory import KVMemory
from app.engine.request import Status
from app.engine.scheduling.batch import ScheduledBatch, decode_batch
from app.engine.scheduling.limits import SchedulerLimits
from app.engine.scheduling.pipeline import LaunchedStep
from app.engine.scheduling.prefill import PrefillManager
from app.engine.scheduling.retraction import Retraction
from app.engine.scheduling.running import RunningBatch
from app.engine.scheduling.waiting import WaitingQueue


class _CompleteFirst(Exception):
    """No step goes ahead: the step in flight is completed and the next scheduled plainly."""


class RunAhead:
    """Decides, with overlap on, which step is queued behind the one in flight (see the module doc)."""

    def __init__(
        self,
        *,
        enabled: bool,
        limits: SchedulerLimits,
        memory: KVMemory,
        waiting: WaitingQueue,
        prefill: PrefillManager,
        running: RunningBatch,
        retraction: Retraction,
    ) -> None:
        self.enabled = enabled
        self.retraction = retraction  # a due preemption needs the plain schedule's up-to-date view
        self.limits = limits
        self.memory = memory
        self.waiting = waiting
        self.prefill = prefill
        self.running = running
        self.prefills_ahead = 0  # prefill steps queued behind a step in flight

    def next_step(self, launched: LaunchedStep) -> ScheduledBatch | None:
        """The step to queue behind ``launched`` before its tokens are read, or None (complete
        it first). Prompts that fit go first; when none does (KV is short), decoding goes on,
        unless the waiting head is to preempt a running request (retraction.py)."""
        try:
            return self._prefill_ahead(launched) or self._decode_ahead(launched) or self._decode_after_prefill(launched)
        except _CompleteFirst:
            return None

    def keeps_in_flight(self, batch: ScheduledBatch) -> bool:
        """Whether a step just launched is left running for the next step() to complete: every
        decode step, and a prefill step when a step can follow it without its tokens (more
        prompts: _prefill_ahead; the decode of its joiners: _decode_after_prefill)."""
        if not self.enabled:
            return False
        return batch.mode is ForwardMode.DECODE or any(batch.samples) or self.prefill.has_work()

    def _prefill_ahead(self, launched: LaunchedStep) -> ScheduledBatch | None:
        """The next prefill step, or None.

        Behind a prefill step, its budget counts that step's joiners as running already; not
        while requests are leaving, since their sampling rows must go before new ones are added
        behind rows still in flight. Behind a decode step, its requests are running already
        (those that left keep their rows until the prefill is processed, then go together)."""
        if not self.enabled or not self.prefill.has_work():
            return None
        if launched.batch.mode is not ForwardMode.EXTEND:
            batch = self.prefill.schedule(self.running)
            if batch is None and self.retraction.preemption_victim(self.running.staying()) is not None:
                raise _CompleteFirst  # requests in flight are not retracted: the plain schedule preempts
        elif self.running.leavers:
            return None
        else:
            joiners = [r for r, s in zip(launched.batch.reqs, launched.batch.samples) if s]
            batch = self.prefill.schedule(self.running, in_flight=joiners)
        if batch is not None:
            self.prefills_ahead += 1
        return batch

    def _decode_ahead(self, launched: LaunchedStep) -> ScheduledBatch | None:
        """When the step after ``launched`` is a decode step of the same requests, less those
        that left meanwhile (finished or aborted: they are dropped from the batch here), that
        step, its input ids ``launched``'s samples of the staying rows on the device; else None.
        Asked only when no prefill step could be scheduled ahead: prompts may wait (for KV to
        free up) and the running requests decode meanwhile, as the plain schedule would."""
        if not self.enabled or launched.batch.mode is not ForwardMode.DECODE or launched.batch_tokens is None:
            return None
        reqs = launched.batch.reqs
        running = self.running.reqs
        if len(reqs) != len(running) or any(a is not b for a, b in zip(reqs, running)):
            return None
        staying = self.running.staying()
        if not staying or any(r.kv_len + 1 >= self.limits.context_len for r in staying):
            return None  # the plain schedule finishes them
        if self.memory.available() < self.memory.slots_needed(staying, [1] * len(staying)):
            return None
        tokens = launched.batch_tokens
        if len(staying) < len(reqs):
            keep = self.running.flush_leavers()  # the batch becomes ``staying``; their sampling rows, in order
            assert keep is not None
            tokens = tokens[tensor_on(keep, torch.int64, tokens.device)]
        return self.running.decode_batch(input_ids=tokens)

    def _decode_after_prefill(self, launched: LaunchedStep) -> ScheduledBatch | None:
        """With the last prefill step in flight, the decode step after it: every running
        request, then the prefill's joiners (the order of their sampling rows), fed the running
        requests' last tokens from the host and the joiners' first tokens straight from the
        device; or None when that step is not certain (someone left, a prompt is part-way in,
        KV is short, or every joiner ends with its first token). Asked only when no further
        prefill step could be scheduled ahead (prompts that wait for KV wait as they would)."""
        if not self.enabled or launched.batch.mode is not ForwardMode.EXTEND or launched.batch_tokens is None:
            return None
        running = self.running.reqs
        if self.prefill.partial is not None or self.running.leavers:
            return None
        joiners = launched.batch.reqs
        if not all(launched.batch.samples) or any(r.status is not Status.PREFILLING for r in joiners):
            return None  # a chunk still to come, or a joiner aborted while in flight
        if not running and all(r.params.max_new_tokens <= len(r.output_ids) + 1 for r in joiners):
            return None  # they all end with the prefill's token: nothing to decode
        reqs = [*running, *joiners]
        if any(r.kv_len + 1 >= self.limits.context_len for r in reqs):
            return None
        if self.memory.available() < self.memory.slots_needed(reqs, [1] * len(reqs)):
            return None
        device = launched.batch_tokens.device
        last = tensor_on([r.fill_slice(r.kv_len, r.kv_len + 1)[0] for r in running], torch.int64, device)
        ids = torch.cat([last, launched.batch_tokens.to(torch.int64)])
        return decode_batch(reqs, input_ids=ids)
