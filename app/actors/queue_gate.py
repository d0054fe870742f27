"""The ingress's early refusal for ``--max-queued-requests``: a full queue answered without a
trip through the actors.

The scheduler's ``WaitingQueue`` is the exact bound, but its refusal comes back after the
request was tokenized and carried through three channels, and after the forward step the
scheduler was in; under overload, on a busy machine, that took tens of milliseconds. The
ingress can decide most refusals itself from what it already knows: every request it sent and
has not yet seen finish is running, waiting, or on its way to the scheduler, and at most
``max_running`` of them run. So when

    unfinished ≥ max_running + max_queued

at least ``max_queued`` requests are waiting or in transit ahead of the arrival, and the
scheduler would refuse it too. The one error is a request that finished in the scheduler and
whose last output is still on its way back (a step's worth of time): the gate may refuse an
arrival the scheduler would have queued a millisecond later, the same race any arrival at a full
queue has with the next admission. Below the bound the request goes on, and ``WaitingQueue``
decides exactly (a running batch held below ``max_running`` by the KV pool leaves more waiting
than this bound sees).

With ``--enable-priority-scheduling`` the gate stays open: a more important arrival at a full
queue evicts the least important waiting request, and only the scheduler knows which requests
wait.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QueueGate:
    """Whether an arrival can be refused at the ingress; ``bound`` None: never (no queue limit,
    or priorities)."""

    bound: int | None  # unfinished requests at which the queue is certainly full

    @classmethod
    def for_limits(cls, max_queued: int | None, max_running: int, priority_scheduling: bool) -> QueueGate:
        """The gate for the server's limits; ``max_running`` must not be below the scheduler's
        (an upper bound keeps the gate exact on the side of admitting)."""
        if max_queued is None or priority_scheduling:
            return cls(None)
        return cls(max_running + max_queued)

    def refuses(self, unfinished: int) -> bool:
        """True when an arrival that finds ``unfinished`` requests in flight finds the queue full."""
        return self.bound is not None and unfinished >= self.bound
