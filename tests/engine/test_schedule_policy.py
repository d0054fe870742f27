"""--schedule-policy without a model: lpm offers the waiting request with the longest cached
prefix first (within a priority rank, arrival breaking ties), and falls back to the queue's
order above LPM_MAX_WAITING waiting; fcfs keeps arrival order. The radix cache's read-only
query that lpm asks agrees with what admission would match and changes nothing."""

from __future__ import annotations

import pytest
import torch

from app.engine.radix_cache import RadixCache
from app.engine.request import Request
from app.engine.scheduling.waiting import LPM_MAX_WAITING, Priorities, WaitingQueue
from app.ipc.messages import SamplingParams


def request(rid: str, prompt: list[int], priority: int = 0) -> Request:
    req = Request(rid, prompt, SamplingParams(max_new_tokens=4), seed=1)
    req.priority = priority
    return req


def queue_of(reqs: list[Request], **options) -> WaitingQueue:  # noqa: ANN003
    queue = WaitingQueue(context_len=4096, kv_capacity=10_000, **options)
    for req in reqs:
        queue.push(req)
    return queue


CACHED = {"a": 0, "b": 8, "c": 2, "d": 8, "e": 0}  # tokens each one finds in the prefix cache


def cached(req: Request) -> int:
    return CACHED[req.rid]


def test_lpm_offers_the_longest_cached_prefix_first_and_arrival_breaks_ties():
    queue = queue_of([request(rid, [1, 2, 3]) for rid in "abcde"], policy="lpm")
    queue.order_for_prefill(cached)
    assert [r.rid for r in queue] == ["b", "d", "c", "a", "e"]
    fcfs = queue_of([request(rid, [1, 2, 3]) for rid in "abcde"])
    fcfs.order_for_prefill(cached)
    assert [r.rid for r in fcfs] == ["a", "b", "c", "d", "e"]


def test_lpm_sorts_within_a_priority_rank():
    reqs = [request("a", [1], 5), request("b", [1], 0), request("c", [1], 5), request("d", [1], 0)]
    queue = queue_of(reqs, policy="lpm", priorities=Priorities(enabled=True))
    queue.order_for_prefill(cached)
    assert [r.rid for r in queue] == ["c", "a", "b", "d"]  # priority 5 before 0, then longest prefix, then arrival
    queue.push(request("e", [1], 5))  # an arrival still goes behind its rank
    assert [r.rid for r in queue] == ["c", "a", "e", "b", "d"]


def test_lpm_orders_as_fcfs_when_too_many_wait():
    reqs = [request(f"r{i}", [1]) for i in range(LPM_MAX_WAITING + 1)]
    longest_last = {r.rid: i for i, r in enumerate(reqs)}
    queue = queue_of(reqs, policy="lpm")
    queue.order_for_prefill(lambda r: longest_last[r.rid])
    assert [r.rid for r in queue] == [r.rid for r in reqs]
    queue.pop()  # LPM_MAX_WAITING left: sorted again
    queue.order_for_prefill(lambda r: longest_last[r.rid])
    assert [r.rid for r in queue] == [r.rid for r in reversed(reqs[1:])]


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_cached_prefix_length_matches_admission_and_changes_nothing(page_size):
    freed: list[torch.Tensor] = []
    cache = RadixCache(freed.append, page_size=page_size)
    cache.insert(list(range(16)), torch.arange(16))
    cache.insert([*range(8), 100, 101, 102, 103], torch.arange(16, 28))
    stamps = {id(n): (n.last_access, n.key) for n in cache._nodes()}
    for tokens in ([*range(6)], [*range(10), 99], [*range(8), 100, 101, 7], [50, 51], list(range(16)), []):
        expected = len(tokens) - len(tokens) % page_size
        length = cache.cached_prefix_len(tokens)
        assert {id(n): (n.last_access, n.key) for n in cache._nodes()} == stamps  # no split, no access stamp
        assert length == cache.match_prefix(tokens).num_tokens
        assert length <= expected
        stamps = {id(n): (n.last_access, n.key) for n in cache._nodes()}
    assert RadixCache(freed.append, disabled=True).cached_prefix_len([1, 2, 3]) == 0


def test_an_lpm_engine_admits_the_request_with_a_cached_prefix_first(make_checkpoint):
    """One running slot; a cached prompt's continuation arrives after an unrelated prompt: lpm
    runs the continuation first (its prefix reused), fcfs the unrelated one."""
    from app.engine import Engine
    from engine_checks import assert_pool_clean

    llama = make_checkpoint("llama-tied-llama3")
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    shared = list(range(3, 35))
    first_to_start = {}
    for policy in ("fcfs", "lpm"):
        engine = Engine(str(llama), max_total_tokens=4096, max_running_requests=1, schedule_policy=policy)
        engine.generate(input_ids=[shared], sampling_params=params)  # its KV stays in the prefix cache
        scheduler = engine.scheduler
        scheduler.add_request(Request("unrelated", [40, 41, 42, 43], params, seed=1, stream=True))
        scheduler.add_request(Request("continuation", [*shared, 50], params, seed=1, stream=True))
        outputs = []
        while scheduler.has_work():
            outputs += scheduler.step()
        first_to_start[policy] = outputs[0].rid
        continuation = [o for o in outputs if o.rid == "continuation" and o.usage is not None]
        assert continuation[0].usage.cached_tokens == len(shared)
        assert_pool_clean(engine)
    assert first_to_start == {"fcfs": "unrelated", "lpm": "continuation"}
