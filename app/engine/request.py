"""One request's state inside the engine, from admission to its final output."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from app.engine.radix_cache import RadixNode
from app.ipc.messages import Finish, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # in the waiting queue (new, or retracted to be recomputed)
    PREFILLING = "prefilling"  # admitted; its prompt is being computed chunk by chunk
    RUNNING = "running"  # decoding: one new token per step
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A request and where its KV lives.

    KV layout, with ``row`` its row of the request table::

        req_to_token[row]:  | tree-owned prefix | own slots          | (unused)
                            0              node.depth            kv_len
        fill_ids:           | prompt ........................| outputs ...|
                                                  kv_len ≤ len(fill_ids)

    ``node`` is the radix node this request has locked: the tree owns the slots of positions
    before ``node.depth``; the request owns ``[node.depth, kv_len)`` and frees or caches them
    when it ends. The last output token has no KV yet: the next decode step computes it.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the seeded random stream (its own seed, or one drawn at arrival)
    stream: bool = False
    priority: int = 0
    arrival_time: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int | None = None  # request-table row while admitted
    kv_len: int = 0  # leading fill_ids whose KV is in the pool
    node: RadixNode | None = None  # the locked radix node while admitted
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (reported in usage)
    finish: Finish | None = None
    sent_tokens: int = 0  # output tokens already reported
    reported: bool = False  # whether any output was sent (the first carries usage and TextParams)
    # Log-probabilities of chosen tokens (and top alternatives), not yet reported.
    pending_logprobs: list[float] = field(default_factory=list)
    pending_top_ids: list[list[int]] = field(default_factory=list)
    pending_top_logprobs: list[list[float]] = field(default_factory=list)
    times_retracted: int = 0
    max_len: int = 1 << 62  # prompt + output may not exceed this (the context length)
    traceparent: str | None = None  # W3C trace context (--enable-trace): the scheduler's spans join the trace

    @property
    def fill_ids(self) -> list[int]:
        """Prompt and outputs: what the KV must cover (all but the last token) to decode on."""
        return self.prompt_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` without building the whole list (a decode step needs one
        token of a possibly long sequence)."""
        prompt_len = len(self.prompt_ids)
        if end <= prompt_len:
            return self.prompt_ids[start:end]
        if start >= prompt_len:
            return self.output_ids[start - prompt_len : end - prompt_len]
        return self.prompt_ids[start:] + self.output_ids[: end - prompt_len]

    @property
    def fill_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def reports_incrementally(self) -> bool:
        """Streamed requests, and those with stop strings (the detokenizer must see text as it
        comes), get every step's tokens; others get one output when they finish."""
        return self.stream or bool(self.params.stop)

    def remaining_new_tokens(self) -> int:
        """Tokens it may still generate: by max_new_tokens and by the room left in the context."""
        return max(0, min(self.params.max_new_tokens - len(self.output_ids), self.max_len - self.fill_len))
