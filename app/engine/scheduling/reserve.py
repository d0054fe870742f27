"""The admission reserve: the share of each running request's remaining output that a prefill
step keeps free in the KV pool (SGLang's ``new_token_ratio``).

A prefill step admits a waiting request only while the pool keeps, for every running request,
``ratio`` × the tokens it may still generate (``PrefillBudget``, prefill.py). Too large a share
leaves the pool idle (most requests stop long before ``max_tokens``); too small a share admits
more than decode can hold, and decode retracts requests (retraction.py), whose work is then
recomputed. So the share adapts, as SGLang's does:

- it starts at ``INITIAL_RATIO`` × ``--schedule-conservativeness`` (at most 1);
- every forward step lowers it linearly, reaching the floor, ``FLOOR_RATIO`` ×
  ``--schedule-conservativeness``, after ``DECAY_STEPS`` steps: while nothing is retracted,
  admission grows bolder;
- a retraction sets it back to the initial share (the guess was too bold).

Our figures: initial 0.4, floor 0.1, 600 steps. The floor and the decay span are SGLang's; its
initial share is 0.7, ours is 0.4, the fixed share this engine admitted with before the reserve
adapted, so that admission at start and after a retraction stays as it was (and so do the
throughput figures measured with it), and the decay only ever admits more.

Cost: nothing per decode step. The clock is the pipeline's forward-step counter (prefill steps
count too), read only when a prefill step's budget is made; a retraction records the step it
happened at.
"""

from __future__ import annotations

from collections.abc import Callable

INITIAL_RATIO = 0.4  # share reserved at start and after a retraction (× --schedule-conservativeness)
FLOOR_RATIO = 0.1  # the least share the decay reaches (× --schedule-conservativeness)
DECAY_STEPS = 600  # forward steps from the initial share down to the floor


class AdmissionReserve:
    """The adaptive new-token ratio (see the module doc), on a step clock it reads when asked."""

    def __init__(self, conservativeness: float, clock: Callable[[], int]) -> None:
        self.initial = min(INITIAL_RATIO * conservativeness, 1.0)
        self.floor = min(FLOOR_RATIO * conservativeness, self.initial)
        self.decay_per_step = (self.initial - self.floor) / DECAY_STEPS
        self.clock = clock  # forward steps run so far
        self.reset_at = clock()  # the step of the last retraction (or of the start)

    def ratio(self) -> float:
        """The share of each running request's remaining tokens to keep free now."""
        return max(self.floor, self.initial - (self.clock() - self.reset_at) * self.decay_per_step)

    def reset(self) -> None:
        """A request was retracted: back to the initial share."""
        self.reset_at = self.clock()
