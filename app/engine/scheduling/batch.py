"""One scheduled step: which requests run, how many tokens each computes, which ones sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.forward_batch import ForwardMode
from app.engine.request import Request


@dataclass(slots=True)
class ScheduledBatch:
    """A step's batch, as the schedule chose it and the pipeline runs it."""

    mode: ForwardMode
    reqs: list[Request]
    extend_lens: list[int]
    samples: list[bool]  # per request: this step completes its prompt (or decodes): sample
    # The input ids on the device when the host does not know them yet (a step queued ahead of
    # the previous step's tokens: run_ahead.py); None: read from the requests' tokens.
    input_ids: torch.Tensor | None = None


def decode_batch(reqs: list[Request], input_ids: torch.Tensor | None = None) -> ScheduledBatch:
    """A decode step of ``reqs`` (the list is the batch's own): one token each, every one sampled."""
    n = len(reqs)
    return ScheduledBatch(ForwardMode.DECODE, reqs, [1] * n, [True] * n, input_ids)
