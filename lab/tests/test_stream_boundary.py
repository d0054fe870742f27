"""lab/tools/bench_stream_boundary.py's streaming kernel sums what it streams: one buffer or two, over
programs with unequal tile counts, with and without the grid barrier between the streams (on a
CPU only a one-program grid passes a barrier: programs run one after another), and as a
programmatic dependent on a GPU; its fit recovers a known rate and fixed cost."""

from __future__ import annotations

import pytest
import torch

from bench_stream_boundary import TILE, fit, stream


def tiles(count: int, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(count * TILE, generator=gen).to(torch.bfloat16).to(device)


def per_program(buffer: torch.Tensor, programs: int) -> torch.Tensor:
    """Each program's float32 sum of its tiles pid, pid + P, ..."""
    rows = buffer.float().view(-1, TILE).sum(dim=1).cpu()
    return torch.stack([rows[p::programs].sum() for p in range(programs)])


@pytest.mark.parametrize(("a_tiles", "b_tiles", "programs"), [(7, 0, 3), (5, 4, 3), (2, 3, 4)],
                         ids=["one-stream", "two-streams", "idle-programs"])
def test_each_program_sums_its_tiles(a_tiles: int, b_tiles: int, programs: int, device: torch.device) -> None:
    a = tiles(a_tiles, device, 1)
    b = tiles(b_tiles, device, 2) if b_tiles else None
    sums = torch.full((programs,), float("nan"), device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    stream(a, b, sums, counter)
    expected = per_program(a, programs) + (per_program(b, programs) if b is not None else 0)
    assert torch.allclose(sums.cpu(), expected, rtol=1e-4, atol=1e-2)
    assert int(counter) == 0  # no barrier: the counter untouched


@pytest.mark.parametrize(("b_tiles", "early"), [(2, 1), (6, 4), (3, 4)], ids=["one-early", "four-early", "fewer-than-early"])
def test_the_barrier_between_the_streams(b_tiles: int, early: int, device: torch.device) -> None:
    """One program (what an interpreted grid can pass): its first ``early`` tiles of B before the
    barrier (zeros past B's end), its ticket on the counter, the rest of B after it."""
    a, b = tiles(3, device, 3), tiles(b_tiles, device, 4)
    sums = torch.zeros(1, device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    stream(a, b, sums, counter, barrier=True, early_tiles=early)
    assert int(counter) == 1
    assert torch.allclose(sums.cpu(), per_program(a, 1) + per_program(b, 1), rtol=1e-4, atol=1e-2)


def test_refusals(device: torch.device) -> None:
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    sums = torch.zeros(2, device=device)
    with pytest.raises(ValueError, match=f"whole tiles of {TILE} elements"):
        stream(torch.zeros(TILE + 1, dtype=torch.bfloat16, device=device), None, sums, counter)
    with pytest.raises(ValueError, match="early_tiles must be a power of two, got 3"):
        stream(tiles(1, device, 5), None, sums, counter, early_tiles=3)
    if device.type != "cuda":
        with pytest.raises(ValueError, match="programmatic dependent launch needs a CUDA device"):
            stream(tiles(1, device, 5), None, sums, counter, preload=True)


def test_fit_recovers_rate_and_fixed_cost() -> None:
    rows = [{"mb": mb, "us": mb / 4.5 + 3.0} for mb in (4.0, 16.0, 64.0, 256.0)]
    rate, fixed = fit(rows)
    assert rate == pytest.approx(4.5) and fixed == pytest.approx(3.0)


@pytest.mark.gpu
def test_dependent_and_barrier_launches_on_a_gpu() -> None:
    """The two launches with B a preloading dependent of A, and the barrier kernel over two
    programs an SM (all resident), sum what they stream."""
    device = torch.device("cuda")
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    a, b = tiles(3 * programs + 5, device, 6), tiles(programs + 7, device, 7)
    sums_a, sums_b = torch.zeros(programs, device=device), torch.zeros(programs, device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    for early in (1, 4):
        stream(a, None, sums_a, counter, trigger=True)
        stream(b, None, sums_b, counter, preload=True, early_tiles=early)
        assert torch.allclose(sums_a.cpu(), per_program(a, programs), rtol=1e-4, atol=1e-2)
        assert torch.allclose(sums_b.cpu(), per_program(b, programs), rtol=1e-4, atol=1e-2)
        fused = torch.zeros(programs, device=device)
        counter.zero_()
        stream(a, b, fused, counter, barrier=True, early_tiles=early)
        assert int(counter) == programs
        assert torch.allclose(fused.cpu(), per_program(a, programs) + per_program(b, programs), rtol=1e-4, atol=1e-2)
