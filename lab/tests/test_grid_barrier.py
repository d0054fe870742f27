"""lab/tools/bench_grid_barrier.py's barrier: every program's ticket counted, no program past it
before every slice of its phase is written. On a CPU (interpreted, programs run one after
another) only a one-program grid can pass a barrier; the GPU test runs a grid of every SM."""

from __future__ import annotations

import pytest
import torch

from bench_grid_barrier import SLICE, run_phases


def run_checked(programs: int, phases: int, device: torch.device) -> tuple[int, int, torch.Tensor]:
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    errors = torch.zeros(1, dtype=torch.int32, device=device)
    sink = torch.zeros(programs * SLICE, dtype=torch.float32, device=device)
    run_phases(counter, sink, programs, phases, barrier=True, errors=errors)
    return int(counter), int(errors), sink


def test_one_program_passes_each_barrier_with_its_own_ticket(device: torch.device) -> None:
    counter, errors, sink = run_checked(1, 3, device)
    assert (counter, errors) == (3, 0)
    assert torch.equal(sink.cpu(), torch.full((SLICE,), 3.0))


@pytest.mark.gpu
def test_every_sm_waits_for_every_other_at_each_barrier() -> None:
    device = torch.device("cuda")
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    for _ in range(5):  # an early pass is a race: give it several chances to show
        counter, errors, sink = run_checked(programs, 8, device)
        assert (counter, errors) == (8 * programs, 0)
        assert torch.equal(sink, torch.full_like(sink, 8.0))
