"""Radix prefix cache: structure, ownership of slots, accounting and LRU eviction.

A fake allocator (a set of free slots) checks that every slot goes back exactly once and that
none leaks; ``assert_accounting`` runs after every operation.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from app.engine.radix_cache import RadixCache, RadixNode


class FakePool:
    """Slots 0..capacity-1; raises on a double free or a free of a slot never handed out."""

    def __init__(self, capacity: int = 1000, device: str = "cpu") -> None:
        self.capacity = capacity
        self.device = torch.device(device)
        self.free_set = set(range(capacity))
        self.last_freed: list[int] = []  # slots of the most recent free() calls since reset_log()

    def alloc(self, n: int) -> torch.Tensor:
        if n > len(self.free_set):
            raise MemoryError(n)
        taken = sorted(self.free_set)[:n]
        self.free_set.difference_update(taken)
        return torch.tensor(taken, dtype=torch.int64, device=self.device)

    def free(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64 and slots.dim() == 1 and slots.device.type == self.device.type
        values = slots.tolist()
        assert len(set(values)) == len(values), f"duplicate slots in one free: {values}"
        for s in values:
            assert 0 <= s < self.capacity, f"foreign slot {s}"
            assert s not in self.free_set, f"double free of slot {s}"
        self.free_set.update(values)
        self.last_freed.extend(values)

    def reset_log(self) -> None:
        self.last_freed = []

    def used(self) -> set[int]:
        return set(range(self.capacity)) - self.free_set


def assert_accounting(cache: RadixCache, pool: FakePool, caller_owned: set[int] = frozenset()) -> None:
    """Evictable and locked are disjoint, each recomputed from the tree, and with the free list and
    the caller's slots account for every slot exactly once."""
    cache.check()
    tree_slots = cache.all_slots().tolist()
    assert len(set(tree_slots)) == len(tree_slots), "a slot appears twice in the tree"
    assert cache.evictable_size() + cache.locked_size() == len(tree_slots) == cache.total_size()
    assert cache.evictable_size() >= 0 and cache.locked_size() >= 0
    assert not set(tree_slots) & pool.free_set, "the tree holds a free slot"
    assert not set(tree_slots) & set(caller_owned), "the tree holds a caller's slot"
    assert pool.used() == set(tree_slots) | set(caller_owned), "leaked or unaccounted slots"


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return request.param


@pytest.fixture
def pool() -> FakePool:
    return FakePool()


@pytest.fixture
def cache(pool: FakePool) -> RadixCache:
    return RadixCache(pool.free)


def insert_fresh(cache: RadixCache, pool: FakePool, tokens: list[int]) -> tuple[RadixNode, torch.Tensor]:
    """A request with no cache hit finishes: all of its slots go to the tree."""
    s = pool.alloc(len(tokens))
    r = cache.insert(tokens, s)
    assert r.num_tokens == len(tokens)
    return r.node, r.slots


def test_insert_then_match_exact_and_partial(cache: RadixCache, pool: FakePool) -> None:
    _, s = insert_fresh(cache, pool, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.num_tokens == 4 and m.slots.tolist() == s.tolist()
    assert cache.match_prefix([9, 1]).num_tokens == 0
    assert cache.match_prefix([]).num_tokens == 0
    m = cache.match_prefix([1, 2])
    assert m.num_tokens == 2 and m.slots.tolist() == s[:2].tolist() and m.node.depth == 2
    assert_accounting(cache, pool)


def test_split_keeps_the_deeper_node_and_its_lock(cache: RadixCache, pool: FakePool) -> None:
    node, s = insert_fresh(cache, pool, [1, 2, 3, 4])
    cache.lock(node)
    assert cache.locked_size() == 4 and cache.evictable_size() == 0
    m = cache.match_prefix([1, 2, 9])  # ends inside the edge: split into [1 2] → [3 4]
    assert m.num_tokens == 2 and m.node is not node
    assert node.parent is m.node and node.depth == 4 and m.node.lock_ref == node.lock_ref == 1
    assert cache.locked_size() == 4
    assert_accounting(cache, pool)
    cache.unlock(node)
    assert cache.locked_size() == 0 and cache.evictable_size() == 4
    assert_accounting(cache, pool)


def test_insert_branch_and_duplicates_are_freed_by_the_tree(cache: RadixCache, pool: FakePool) -> None:
    _, first = insert_fresh(cache, pool, [1, 2, 3, 4])
    dup = pool.alloc(6)  # computed [1 2 3 9 9 9] without a cache hit: [1 2 3] is computed twice
    pool.reset_log()
    r = cache.insert([1, 2, 3, 9, 9, 9], dup)
    assert r.num_cached == 3 and r.num_tokens == 6
    assert sorted(pool.last_freed) == sorted(dup[:3].tolist())  # the duplicates, and only them
    assert r.slots.tolist() == first[:3].tolist() + dup[3:].tolist()
    assert cache.total_size() == 7
    assert_accounting(cache, pool)


def test_insert_existing_sequence_frees_all_duplicates(cache: RadixCache, pool: FakePool) -> None:
    insert_fresh(cache, pool, [5, 6, 7])
    again = pool.alloc(3)
    r = cache.insert([5, 6, 7], again)
    assert r.num_cached == 3 and not set(again.tolist()) & pool.used()
    assert_accounting(cache, pool)


def test_insert_with_held_prefix_frees_only_new_duplicates(cache: RadixCache, pool: FakePool) -> None:
    insert_fresh(cache, pool, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2])
    cache.lock(m.node)
    own = pool.alloc(3)  # the request computed [3 4 5] itself; meanwhile the tree has them too
    pool.reset_log()
    r = cache.insert([1, 2, 3, 4, 5], torch.cat([m.slots, own]), held=m.node)
    assert r.num_cached == 5 and sorted(pool.last_freed) == sorted(own.tolist())
    cache.unlock(m.node)
    assert_accounting(cache, pool)


def test_insert_rejects_bad_arguments(cache: RadixCache, pool: FakePool) -> None:
    node, _ = insert_fresh(cache, pool, [1, 2, 3])
    with pytest.raises(ValueError, match="slots"):
        cache.insert([1, 2], slots(1))
    with pytest.raises(ValueError, match="past"):
        cache.insert([1, 2], pool.alloc(2), held=node)
    other, _ = insert_fresh(cache, pool, [7, 8, 9])
    s = torch.cat([cache.match_prefix([1, 2, 3]).slots, pool.alloc(1)])
    with pytest.raises(ValueError, match="not on the path"):
        cache.insert([1, 2, 3, 4], s, held=other)
    pool.free(s[3:])


def test_lru_order(cache: RadixCache, pool: FakePool) -> None:
    a, sa = insert_fresh(cache, pool, [1, 1])
    b, sb = insert_fresh(cache, pool, [2, 2])
    c, sc = insert_fresh(cache, pool, [3, 3])
    cache.match_prefix([1, 1])  # a is now the most recent
    pool.reset_log()
    assert cache.evict(2) == 2
    assert sorted(pool.last_freed) == sorted(sb.tolist())
    assert cache.evict(2) == 2
    assert sorted(pool.last_freed) == sorted(sb.tolist() + sc.tolist())
    assert cache.match_prefix([1, 1]).num_tokens == 2
    assert_accounting(cache, pool)


def test_eviction_cascades_to_parents_that_become_leaves(cache: RadixCache, pool: FakePool) -> None:
    insert_fresh(cache, pool, [1, 2, 3, 4])
    insert_fresh(cache, pool, [1, 2, 5, 6])  # [1 2] → {[3 4], [5 6]}
    insert_fresh(cache, pool, [9])
    cache.match_prefix([9])
    assert cache.evict(5) == 6  # both branches, then their parent, before [9]; whole leaves only
    assert cache.match_prefix([1]).num_tokens == 0 and cache.match_prefix([9]).num_tokens == 1
    assert cache.evict(100) == 1 and cache.total_size() == 0
    assert pool.used() == set()
    assert_accounting(cache, pool)


def test_locked_nodes_are_never_evicted(cache: RadixCache, pool: FakePool) -> None:
    node, s = insert_fresh(cache, pool, [1, 2, 3])
    insert_fresh(cache, pool, [1, 2, 4, 4])
    insert_fresh(cache, pool, [7, 7])
    cache.lock(node)
    assert cache.evict(1000) == 4  # [4 4] and [7 7]; [1 2] and [3] are held
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == s.tolist()
    assert cache.locked_size() == 3 and cache.evictable_size() == 0
    assert_accounting(cache, pool)
    cache.unlock(node)
    assert cache.evict(1000) == 3
    assert_accounting(cache, pool)


def test_lock_counts_and_unbalanced_unlock(cache: RadixCache, pool: FakePool) -> None:
    node, _ = insert_fresh(cache, pool, [1, 2])
    cache.lock(node)
    cache.lock(node)
    cache.unlock(node)
    assert cache.locked_size() == 2
    cache.unlock(node)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(node)
    assert_accounting(cache, pool)


def test_stale_handles_are_rejected(cache: RadixCache, pool: FakePool) -> None:
    node, _ = insert_fresh(cache, pool, [1, 2])
    cache.evict(10)
    with pytest.raises(ValueError, match="no longer"):
        cache.lock(node)
    node, _ = insert_fresh(cache, pool, [3])
    cache.reset()
    with pytest.raises(ValueError, match="no longer"):
        cache.lock(node)
    assert_accounting(cache, pool)


def test_reset_frees_everything_once_and_refuses_while_locked(cache: RadixCache, pool: FakePool) -> None:
    node, _ = insert_fresh(cache, pool, [1, 2, 3])
    insert_fresh(cache, pool, [1, 4])
    cache.lock(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    assert_accounting(cache, pool)
    cache.unlock(node)
    cache.reset()
    assert cache.total_size() == 0 and pool.used() == set()
    assert cache.match_prefix([1, 2, 3]).num_tokens == 0
    assert_accounting(cache, pool)


def test_disabled_cache_matches_nothing_and_leaves_slots_to_the_caller(pool: FakePool) -> None:
    cache = RadixCache(pool.free, disabled=True)
    s = pool.alloc(3)
    r = cache.insert([1, 2, 3], s)
    assert (r.num_cached, r.num_tokens, len(r.slots)) == (0, 0, 0)
    assert cache.match_prefix([1, 2, 3]).num_tokens == 0
    cache.lock(r.node)
    cache.unlock(r.node)
    assert cache.evict(10) == 0 and cache.total_size() == 0
    assert_accounting(cache, pool, caller_owned=set(s.tolist()))
    pool.free(s[r.num_tokens :])  # the finishing request frees what the tree did not take
    assert pool.used() == set()


def test_page_size_rounds_matches_and_inserts_down(device: str) -> None:
    pool = FakePool(device=device)
    cache = RadixCache(pool.free, page_size=2, device=device)
    s = pool.alloc(5)
    r = cache.insert([1, 2, 3, 4, 5], s)
    assert r.num_tokens == 4 and r.slots.tolist() == s[:4].tolist()
    assert_accounting(cache, pool, caller_owned={int(s[4])})
    pool.free(s[4:])
    assert cache.match_prefix([1, 2, 3, 9]).num_tokens == 2  # the page [3 9] differs
    assert cache.match_prefix([1, 2, 3]).num_tokens == 2  # [3] is not a whole page
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 4
    m = cache.match_prefix([1, 2])
    cache.lock(m.node)
    r = cache.insert([1, 2, 3, 5, 6, 7], torch.cat([m.slots, pool.alloc(4)]), held=m.node)
    cache.unlock(m.node)  # diverged inside page [3 4]: split after [1 2]
    assert r.num_cached == 2 and r.num_tokens == 6
    assert_accounting(cache, pool)
    assert cache.evict(1) == 2  # the older leaf: [3 4], not the newer [3 5 6 7]
    assert cache.match_prefix([1, 2, 3, 5, 6, 7]).num_tokens == 6
    assert_accounting(cache, pool)


def test_chunked_prefill_protocol(device: str) -> None:
    """A request prefilled in chunks re-inserts what it has computed so far, moves its lock to the
    new node, and at the end gives everything to the tree. Meanwhile another request computed
    part of the same prompt: the tree frees the first request's duplicates, which then uses the
    tree's slots."""
    pool = FakePool(device=device)
    cache = RadixCache(pool.free, device=device)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    insert_fresh(cache, pool, [1, 2, 3, 4])
    m = cache.match_prefix(prompt[:-1])
    assert m.num_tokens == 4
    cache.lock(m.node)
    req_slots, req_node = m.slots.clone(), m.node
    for end in (6, 8):  # chunks [4:6] and [6:8]
        req_slots = torch.cat([req_slots, pool.alloc(end - len(req_slots))])
        if end == 8:  # the other request finishes first, with the whole prompt computed
            _, other = insert_fresh(cache, pool, prompt + [99])
        pool.reset_log()
        r = cache.insert(prompt[:end], req_slots, held=req_node)
        if end == 8:
            assert r.num_cached == 8 and sorted(pool.last_freed) == sorted(req_slots[6:8].tolist())
            assert r.slots.tolist() == other[:8].tolist()
        req_slots[: r.num_tokens] = r.slots
        cache.lock(r.node)
        cache.unlock(req_node)
        req_node = r.node
        assert cache.locked_size() == end
        assert_accounting(cache, pool)
    decoded = pool.alloc(2)  # two generated tokens with KV; the last sampled one has none
    req_slots = torch.cat([req_slots, decoded])
    r = cache.insert(prompt + [42, 43], req_slots, held=req_node)
    cache.unlock(req_node)
    pool.free(req_slots[r.num_tokens :])
    assert cache.locked_size() == 0 and cache.total_size() == 11
    assert_accounting(cache, pool)
    cache.reset()
    assert pool.used() == set()


# ---------------------------------------------------------------- property test against a model


tokens_st = st.lists(st.integers(0, 2), max_size=10)


class RadixMachine(RuleBasedStateMachine):
    """Random insert/match/lock/unlock/evict/reset against a model of what the cache holds.

    The model's unit is the page: ``model`` maps every cached page-aligned prefix (a token tuple
    of length k * page) to the slots of its last page, ``access`` to its last use (the tree stamps
    whole nodes, the model every page on the path: the same thing, seen finer)."""

    @initialize(page_size=st.sampled_from([1, 2, 3]))
    def setup(self, page_size: int) -> None:
        self.pool = FakePool(capacity=2000)
        self.cache = RadixCache(self.pool.free, page_size=page_size)
        self.page = page_size
        self.model: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.access: dict[tuple[int, ...], int] = {}
        self.tick = 0
        self.locks: list[tuple[RadixNode, tuple[int, ...]]] = []

    def pages(self, seq: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
        """The page-aligned prefixes of ``seq[:n]``, shortest first."""
        return [seq[:j] for j in range(self.page, n + 1, self.page)]

    def model_match(self, seq: tuple[int, ...]) -> int:
        n = 0
        while n + self.page <= len(seq) and seq[: n + self.page] in self.model:
            n += self.page
        return n

    def model_slots(self, seq: tuple[int, ...], n: int) -> list[int]:
        return [s for p in self.pages(seq, n) for s in self.model[p]]

    def touch(self, seq: tuple[int, ...], n: int) -> None:
        self.tick += 1
        for p in self.pages(seq, n):
            self.access[p] = self.tick

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        return {p for _, seq in self.locks for p in self.pages(seq, len(seq))}

    def checked_match(self, seq: tuple[int, ...]):  # noqa: ANN201
        m = self.cache.match_prefix(seq)
        n = self.model_match(seq)
        assert m.num_tokens == n and m.node.depth == n
        assert m.slots.tolist() == self.model_slots(seq, n)
        self.touch(seq, n)
        return m

    @rule(seq=tokens_st, via_match=st.booleans(), keep_running=st.booleans())
    def insert(self, seq: list[int], via_match: bool, keep_running: bool) -> None:
        key = tuple(seq)
        held = None
        if via_match:
            m = self.checked_match(key)
            self.cache.lock(m.node)
            held = m.node
            req_slots = torch.cat([m.slots, self.pool.alloc(len(key) - m.num_tokens)])
        else:
            req_slots = self.pool.alloc(len(key))
        n = len(key) - len(key) % self.page
        cached = self.model_match(key)
        h = held.depth if held is not None else 0
        self.pool.reset_log()
        r = self.cache.insert(key, req_slots, held=held)
        assert (r.num_cached, r.num_tokens) == (cached, n)
        assert sorted(self.pool.last_freed) == sorted(req_slots[h:cached].tolist())  # duplicates
        assert r.slots.tolist() == self.model_slots(key, cached) + req_slots[cached:n].tolist()
        for p in self.pages(key, n)[cached // self.page :]:
            self.model[p] = tuple(req_slots[len(p) - self.page : len(p)].tolist())
        self.touch(key, n)
        if keep_running:
            self.cache.lock(r.node)
            self.locks.append((r.node, key[:n]))
        if held is not None:
            self.cache.unlock(held)
        self.pool.free(req_slots[n:])

    @rule(seq=tokens_st)
    def match_and_lock(self, seq: list[int]) -> None:
        m = self.checked_match(tuple(seq))
        self.cache.lock(m.node)
        self.locks.append((m.node, tuple(seq[: m.num_tokens])))

    @rule(seq=tokens_st)
    def match_only(self, seq: list[int]) -> None:
        self.checked_match(tuple(seq))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        node, _ = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)

    @rule(k=st.integers(0, 30))
    def evict(self, k: int) -> None:
        before = self.cache.evictable_size()
        self.pool.reset_log()
        freed = self.cache.evict(k)
        assert freed == len(self.pool.last_freed)
        assert freed >= min(k, before) and (freed == before if before <= k else True)
        gone = set(self.pool.last_freed)
        removed = {p for p, s in self.model.items() if gone.issuperset(s)}
        assert len(removed) * self.page == freed, "freed slots that are not whole cached pages"
        locked = self.locked_prefixes()
        assert not removed & locked, "evicted a locked prefix"
        for p in removed:
            del self.model[p]
        assert all(p[: -self.page] in self.model for p in self.model if len(p) > self.page), "evict left a gap"
        if removed:  # LRU: nothing evicted was used after a leaf that stays evictable
            newest_removed = max(self.access[p] for p in removed)
            parents = {p[: -self.page] for p in self.model}
            for p in self.model:
                if p not in parents and p not in locked:
                    assert self.access[p] >= newest_removed
        for p in removed:
            del self.access[p]

    @rule()
    def reset(self) -> None:
        if self.locked_prefixes():  # a lock on the root (no cache hit) holds no tokens
            with pytest.raises(RuntimeError):
                self.cache.reset()
            return
        self.cache.reset()
        self.model.clear()
        self.access.clear()
        assert self.pool.used() == set()

    @invariant()
    def accounting(self) -> None:
        assert_accounting(self.cache, self.pool)
        assert sorted(self.cache.all_slots().tolist()) == sorted(s for v in self.model.values() for s in v)
        assert self.cache.total_size() == len(self.model) * self.page
        assert self.cache.locked_size() == len(self.locked_prefixes()) * self.page

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for node, _ in self.locks:
            self.cache.unlock(node)
        assert self.cache.locked_size() == 0
        self.cache.reset()
        assert self.pool.used() == set(), "slots leaked"


RadixMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_radix_against_model = RadixMachine.TestCase
