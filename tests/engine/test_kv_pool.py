"""Slot allocator, KV buffers and request table: exact accounting, no slot handed out twice."""

from __future__ import annotations

import pytest
import torch

from app.engine.kv_pool import KVPool, ReqToTokenPool, SlotAllocator, kv_bytes_per_token


def assert_accounting(allocator: SlotAllocator, held: list[torch.Tensor]) -> None:
    """Free and held slots are disjoint, never include page 0, and together make the capacity."""
    free = allocator.free_slots()
    held_all = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
    assert allocator.num_free() == free.numel()
    assert free.numel() + held_all.numel() == allocator.capacity
    every = torch.cat([free, held_all])
    assert every.unique().numel() == every.numel(), "a slot is both free and held, or held twice"
    assert int(every.min()) >= allocator.page_size, "the reserved page was handed out"
    assert int(every.max()) < allocator.num_slots


def test_alloc_free_roundtrip() -> None:
    allocator = SlotAllocator(10)
    assert (allocator.capacity, allocator.num_slots, allocator.num_free()) == (10, 11, 10)
    first = allocator.alloc(4)
    assert first is not None and first.dtype == torch.int64 and first.tolist() == [1, 2, 3, 4]
    second = allocator.alloc(6)
    assert second is not None
    assert_accounting(allocator, [first, second])
    assert allocator.num_free() == 0
    allocator.free(first)
    assert_accounting(allocator, [second])
    allocator.free(second)
    assert_accounting(allocator, [])
    assert allocator.num_free() == 10


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    allocator = SlotAllocator(8)
    held = allocator.alloc(5)
    assert held is not None
    assert allocator.alloc(4) is None
    assert allocator.num_free() == 3
    assert allocator.alloc(0) is not None and allocator.alloc(0).numel() == 0
    rest = allocator.alloc(3)
    assert rest is not None
    assert_accounting(allocator, [held, rest])


def test_random_churn_keeps_exact_accounting() -> None:
    gen = torch.Generator().manual_seed(0)
    allocator = SlotAllocator(64)
    held: list[torch.Tensor] = []
    for _ in range(300):
        if held and torch.rand((), generator=gen) < 0.45:
            allocator.free(held.pop(int(torch.randint(len(held), (), generator=gen))))
        else:
            got = allocator.alloc(int(torch.randint(1, 9, (), generator=gen)))
            if got is not None:
                held.append(got)
        assert_accounting(allocator, held)
    for slots in held:
        allocator.free(slots)
    assert allocator.num_free() == allocator.capacity


def test_double_free_and_bad_slots_are_rejected() -> None:
    allocator = SlotAllocator(8)
    slots = allocator.alloc(3)
    assert slots is not None
    allocator.free(slots[:1])
    with pytest.raises(ValueError, match="double free"):
        allocator.free(slots)
    with pytest.raises(ValueError, match="slot ids must lie in"):
        allocator.free(torch.tensor([0]))
    with pytest.raises(ValueError, match="slot ids must lie in"):
        allocator.free(torch.tensor([9]))
    # The rejected calls changed nothing.
    assert_accounting(allocator, [slots[1:]])


def test_deferred_checks_accept_good_frees_and_report_bad_ones_later() -> None:
    """The CUDA path (one slot per page), run on the CPU: good frees keep the accounting exact
    and check() quiet; a bad one (out of range, reserved, double, repeated) is raised by check()."""
    allocator = SlotAllocator(8, deferred_checks=True)
    held = [allocator.alloc(3), allocator.alloc(2)]
    assert all(h is not None for h in held)
    gen = torch.Generator().manual_seed(3)
    for _ in range(40):  # good frees and allocs in random order: accounting stays exact
        if held and torch.rand((), generator=gen) < 0.5:
            allocator.free(held.pop(int(torch.randint(len(held), (), generator=gen))))
        elif (got := allocator.alloc(int(torch.randint(1, 4, (), generator=gen)))) is not None:
            held.append(got)
        assert_accounting(allocator, held)
        allocator.check()
    for bad in ([0], [9], "double", "repeated"):
        fresh = SlotAllocator(8, deferred_checks=True)
        slots = fresh.alloc(3)
        assert slots is not None
        if bad == "double":
            fresh.free(slots[:1])
            fresh.free(slots[:1])
        elif bad == "repeated":
            fresh.free(torch.stack([slots[0], slots[0]]))
        else:
            fresh.free(torch.tensor(bad))
        with pytest.raises(RuntimeError, match="freed"):
            fresh.check()


def test_deferred_checks_with_pages_free_runs_from_a_page_start() -> None:
    """The CUDA path with pages of 4 slots, run on the CPU: a request's KV from a page-aligned
    position (the last page cut short) and whole cached pages go back exactly; slots that do not
    start at a page's first slot, or skip within a page, are raised by check(), as are the page
    path's double, reserved and repeated frees."""
    allocator = SlotAllocator(32, page_size=4, deferred_checks=True)
    a, b, c = allocator.alloc(8), allocator.alloc(12), allocator.alloc(4)
    assert a is not None and b is not None and c is not None
    allocator.free(b[:10])  # 3 pages, the last cut short: all three go back
    assert_accounting(allocator, [a, c])
    allocator.free(torch.cat([c, a]))  # whole pages, not in page order
    assert_accounting(allocator, [])
    allocator.check()
    gen = torch.Generator().manual_seed(5)
    held: list[torch.Tensor] = []
    for _ in range(60):  # churn: runs cut at random lengths keep the accounting exact
        if held and torch.rand((), generator=gen) < 0.5:
            slots = held.pop(int(torch.randint(len(held), (), generator=gen)))
            allocator.free(slots[: int(torch.randint(slots.numel() - 3, slots.numel() + 1, (), generator=gen))])
        elif (got := allocator.alloc(4 * int(torch.randint(1, 4, (), generator=gen)))) is not None:
            held.append(got)
        assert_accounting(allocator, held)
        allocator.check()
    for bad in ("mid-page", "gap", "double", "reserved", "repeated"):
        fresh = SlotAllocator(16, page_size=4, deferred_checks=True)
        slots = fresh.alloc(8)
        assert slots is not None
        if bad == "mid-page":
            fresh.free(slots[1:])
        elif bad == "gap":
            fresh.free(torch.cat([slots[:2], slots[3:4]]))
        elif bad == "double":
            fresh.free(slots[:4])
            fresh.free(slots[:4])
        elif bad == "reserved":
            fresh.free(torch.arange(4))
        else:
            fresh.free(torch.cat([slots[:4], slots[:4]]))
        with pytest.raises(RuntimeError, match="freed"):
            fresh.check()


def test_pages_are_whole_and_aligned() -> None:
    allocator = SlotAllocator(32, page_size=4)
    assert (allocator.capacity, allocator.num_slots) == (32, 36)
    slots = allocator.alloc(8)
    assert slots is not None
    assert slots.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # page 0 (slots 0..3) is reserved
    with pytest.raises(ValueError, match="multiple of page_size 4"):
        allocator.alloc(3)
    more = allocator.alloc(24)
    assert more is not None and allocator.alloc(4) is None
    pages = torch.cat([slots, more]).view(-1, 4)
    assert (pages[:, 0] % 4 == 0).all() and (pages - pages[:, :1] == torch.arange(4)).all()
    # Freeing the used part of a page returns the whole page.
    allocator.free(slots[:6])
    assert allocator.num_free() == 8
    assert_accounting(allocator, [more])


@pytest.mark.parametrize(("total", "page"), [(0, 1), (10, 4), (8, 0)])
def test_bad_allocator_sizes(total: int, page: int) -> None:
    with pytest.raises(ValueError):
        SlotAllocator(total, page_size=page)


def test_kv_pool_buffers() -> None:
    pool = KVPool(num_slots=11, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, device="cpu")
    assert len(pool.k) == len(pool.v) == 3
    assert pool.k[0].shape == (11, 2, 8) and pool.k[0].dtype == torch.bfloat16
    assert all(float(buf.abs().sum()) == 0 for buf in pool.k + pool.v)  # finite, even where never written
    loc = torch.tensor([3, 7])
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    pool.set_kv(1, loc, k, v)
    assert torch.equal(pool.k[1][loc], k.to(torch.bfloat16)) and torch.equal(pool.v[1][loc], v.to(torch.bfloat16))
    assert float(pool.k[0].abs().sum()) == 0
    assert kv_bytes_per_token(3, 2, 8, torch.bfloat16) == 2 * 3 * 2 * 8 * 2


def test_req_to_token_pool() -> None:
    table = ReqToTokenPool(3, 16)
    assert table.req_to_token.shape == (3, 16) and table.req_to_token.dtype == torch.int32
    rows = table.alloc(2)
    assert rows == [0, 1] and table.num_free() == 1
    assert table.alloc(2) is None and table.num_free() == 1
    table.write(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), torch.tensor([5, 6, 9]))
    assert table.slots(0, 0, 2).tolist() == [5, 6] and table.slots(1, 0, 1).tolist() == [9]
    table.free(rows[0])
    with pytest.raises(ValueError, match="free, repeated or out-of-range"):
        table.free([0])
    with pytest.raises(ValueError, match="free, repeated or out-of-range"):
        table.free([2, 2])
    table.free([1])
    assert table.num_free() == table.capacity == 3
