"""The running batch: the requests that decode, one token each per step, and their sampling rows.

Row ``i`` of ``sampling`` belongs to ``reqs[i]``. A request that leaves (finished, aborted,
retracted) is only marked as a leaver at first: its row stays until :meth:`flush_leavers`
drops every leaver at once, with one filter of the sampling rows, however many left (at the
end of a batch, hundreds finish in one step). With overlap, a step in flight still has the
leavers' rows, so the flush waits until the next step is scheduled (run_ahead.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from app.engine.host_to_device import tensor_on
from app.engine.request import Request, Status
from app.engine.sampling import SampleOutput, SamplingBatch
from app.engine.scheduling.batch import ScheduledBatch, decode_batch


class RunningBatch:
    """The decoding requests, in the row order of their sampling state."""

    def __init__(self, *, vocab_size: int, eos_token_ids: Sequence[int], record_kernel: bool) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.record_kernel = record_kernel  # fused-greedy: the sampler records with one kernel
        self.reqs: list[Request] = []  # decoding, in the row order of ``sampling``
        # Requests that left ``reqs`` (finished, retracted) but whose rows are still in it and in
        # ``sampling``: removed together by flush_leavers, one filter for all of them.
        self.leavers: set[Request] = set()
        self.sampling: SamplingBatch | None = None

    def __len__(self) -> int:
        """Requests in the batch, leavers not flushed yet included."""
        return len(self.reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.reqs)

    def active(self) -> int:
        """Requests that decode on (leavers not counted)."""
        return len(self.reqs) - len(self.leavers)

    def staying(self) -> list[Request]:
        """The requests that decode on, in row order."""
        return [r for r in self.reqs if r not in self.leavers] if self.leavers else self.reqs

    def decode_batch(self, input_ids: torch.Tensor | None = None) -> ScheduledBatch:
        """Every running request, one token each."""
        return decode_batch(list(self.reqs), input_ids)

    def leave(self, req: Request) -> None:
        """Mark ``req`` as gone from the batch (see flush_leavers)."""
        self.leavers.add(req)

    def flush_leavers(self) -> list[int] | None:
        """Drop every request that left from ``reqs`` and its row from ``sampling``: one
        filter however many left. Returns the kept rows' old indices, or None when nobody left."""
        if not self.leavers:
            return None
        keep = [i for i, req in enumerate(self.reqs) if req not in self.leavers]
        self.reqs = [self.reqs[i] for i in keep]
        self.leavers.clear()
        if not keep:
            self.sampling = None
        else:
            assert self.sampling is not None
            self.sampling.filter(keep)
        return keep

    def join(self, reqs: Sequence[Request]) -> None:
        """Requests whose prompt is done decode from now on (their sampling rows were added
        when their prefill step was launched: :meth:`sample_joiners`)."""
        for req in reqs:
            self.reqs.append(req)
            if req.status is Status.FINISHED:  # aborted while its prefill was in flight
                self.leave(req)
            else:
                req.status = Status.RUNNING

    def sample_decode(self, logits: torch.Tensor, argmax_keys: torch.Tensor | None) -> SampleOutput:
        """Sample every row of a decode step."""
        assert self.sampling is not None
        return self.sampling.sample(logits, argmax_keys)

    def sample_joiners(self, batch: ScheduledBatch, logits: torch.Tensor) -> SampleOutput | None:
        """Sample the requests of a prefill step that complete their prompt, and add their
        sampling rows behind the running ones (they join the batch when the step is processed);
        None when nobody completes (a chunk)."""
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
            record_kernel=self.record_kernel,
        )
        if len(picks) != len(batch.reqs):
            logits = logits[tensor_on(picks, torch.int64, logits.device)]
        sampled = new.sample(logits)
        if self.sampling is None:
            self.sampling = new
        else:
            self.sampling.merge(new)
        return sampled
