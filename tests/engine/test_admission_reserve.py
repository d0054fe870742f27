"""The adaptive admission reserve (reserve.py) without a model: its share starts at the
initial ratio, falls linearly to the floor over DECAY_STEPS forward steps, jumps back after a
retraction, and scales with --schedule-conservativeness; the prefill budget keeps that share."""

from __future__ import annotations

import pytest

from app.engine.request import Request
from app.engine.scheduling.prefill import PrefillBudget
from app.engine.scheduling.reserve import DECAY_STEPS, FLOOR_RATIO, INITIAL_RATIO, AdmissionReserve
from app.ipc.messages import SamplingParams


class StepClock:
    """Forward steps, advanced by the test."""

    def __init__(self) -> None:
        self.steps = 0

    def __call__(self) -> int:
        return self.steps


def test_the_share_decays_linearly_to_the_floor_and_jumps_back_after_a_retraction():
    clock = StepClock()
    reserve = AdmissionReserve(1.0, clock)
    assert (INITIAL_RATIO, FLOOR_RATIO, DECAY_STEPS) == (0.4, 0.1, 600)
    assert reserve.ratio() == pytest.approx(0.4)
    clock.steps = 300
    assert reserve.ratio() == pytest.approx(0.25)  # halfway down
    clock.steps = 600
    assert reserve.ratio() == pytest.approx(0.1)
    clock.steps = 5000
    assert reserve.ratio() == pytest.approx(0.1)  # never below the floor
    reserve.reset()  # a retraction
    assert reserve.ratio() == pytest.approx(0.4)
    clock.steps = 5060
    assert reserve.ratio() == pytest.approx(0.37)


@pytest.mark.parametrize(("conservativeness", "initial", "floor"), [(2.0, 0.8, 0.2), (0.5, 0.2, 0.05), (3.0, 1.0, 0.3),
                                                                   (0.0, 0.0, 0.0)])
def test_conservativeness_scales_the_initial_share_and_the_floor(conservativeness, initial, floor):
    clock = StepClock()
    reserve = AdmissionReserve(conservativeness, clock)
    assert reserve.ratio() == pytest.approx(initial)  # capped at 1: never more than the whole output
    clock.steps = DECAY_STEPS
    assert reserve.ratio() == pytest.approx(floor)


def test_the_budget_keeps_the_share_of_each_running_requests_remaining_tokens():
    running = []
    for rid in ("a", "b"):
        req = Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=100), seed=1)
        req.output_ids = [7] * 20  # 80 tokens still to come each
        req.max_len = 4096
        running.append(req)
    clock = StepClock()
    reserve = AdmissionReserve(1.0, clock)
    shares = []
    for steps in (0, DECAY_STEPS):
        clock.steps = steps
        budget = PrefillBudget.for_step(max_prefill_tokens=100, chunk_size=None, available_kv=1000, running=running,
                                        free_rows=4, new_token_ratio=reserve.ratio())
        shares.append(1000 - budget.kv_tokens)
    assert shares == [2 * 32, 2 * 8]  # 0.4 then 0.1 of 80, for each of the two
