"""Splitting a step's worth of outputs into messages that fit a channel's frames.

A ring refuses a frame larger than itself (splitting one frame could not be made
cancellation-safe), so the senders of batched messages (the scheduler's StepOutput, the
detokenizer's TextBatch) cut their batches by an estimate of each item's encoded size: many
long non-streaming answers finishing in the same step must not take the server down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from app.ipc.messages import TextOutput, TokenLogprobs, TokenOutput

T = TypeVar("T")

_PER_ITEM_OVERHEAD = 256  # msgpack framing, rid, finish, usage: generous


def _logprobs_bytes(logprobs: TokenLogprobs | None) -> int:
    if logprobs is None:
        return 0
    return len(logprobs.chosen) + len(logprobs.top_ids) + len(logprobs.top_logprobs)


def token_output_size(output: TokenOutput) -> int:
    """An upper bound of the encoded size of one TokenOutput."""
    return _PER_ITEM_OVERHEAD + len(output.rid) + len(output.token_ids) + _logprobs_bytes(output.logprobs)


def text_output_size(output: TextOutput) -> int:
    """An upper bound of the encoded size of one TextOutput (4 bytes per character at most)."""
    return (_PER_ITEM_OVERHEAD + len(output.rid) + 4 * len(output.text) + len(output.token_ids)
            + _logprobs_bytes(output.logprobs))


def batches_under(items: Sequence[T], size_of: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """Consecutive runs of ``items`` whose estimated sizes add up to at most ``limit``, in order
    (an item larger than ``limit`` on its own still goes, alone: the channel then says so)."""
    batch: list[T] = []
    total = 0
    for item in items:
        size = size_of(item)
        if batch and total + size > limit:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size
    if batch:
        yield batch
