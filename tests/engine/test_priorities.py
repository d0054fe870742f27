"""Priority scheduling without a model: the waiting queue's order and a full queue's eviction."""

from __future__ import annotations

import pytest

from app.engine.request import Request
from app.engine.scheduling import QueueFullError
from app.engine.scheduling.waiting import Priorities, WaitingQueue
from app.ipc.messages import SamplingParams

ON = Priorities(enabled=True)


def request(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=4), seed=1, priority=priority, arrival_time=arrival)


def rids(queue: WaitingQueue) -> list[str]:
    return [r.rid for r in queue]


def test_the_queue_offers_larger_priorities_first_then_arrival_order():
    queue = WaitingQueue(context_len=64, kv_capacity=100, priorities=ON)
    for rid, priority in (("a", 0), ("b", 0), ("c", 100), ("d", -100), ("e", 100), ("f", 0)):
        queue.push(request(rid, priority))
    assert rids(queue) == ["c", "e", "a", "b", "f", "d"]
    queue.push_front(request("retracted", 0))  # ahead of its rank, behind the more important
    assert rids(queue) == ["c", "e", "retracted", "a", "b", "f", "d"]
    queue.push_front(request("retracted-low", -200))  # nobody ranks as low: at the end
    assert rids(queue)[-1] == "retracted-low"


def test_low_values_first_inverts_the_order_and_off_ignores_priorities():
    low_first = WaitingQueue(context_len=64, kv_capacity=100, priorities=Priorities(enabled=True, low_values_first=True))
    off = WaitingQueue(context_len=64, kv_capacity=100)
    for queue in (low_first, off):
        for rid, priority in (("a", 5), ("b", -5), ("c", 0)):
            queue.push(request(rid, priority))
        queue.push_front(request("retracted", 9))
    assert rids(low_first) == ["b", "c", "a", "retracted"]
    assert rids(off) == ["retracted", "a", "b", "c"]  # first come, first served


def test_a_full_queue_evicts_its_least_important_newest_request_for_a_more_important_arrival():
    queue = WaitingQueue(context_len=64, kv_capacity=100, max_queued=3, priorities=ON)
    for rid, priority, arrival in (("old-low", -1, 1.0), ("new-low", -1, 2.0), ("high", 5, 3.0)):
        queue.push(request(rid, priority, arrival))
    with pytest.raises(QueueFullError, match=r"^The request queue is full\.$"):
        queue.check(request("as-low", -1, 4.0))  # not more important than the least: refused
    evicted = queue.check(request("mid", 0, 5.0))
    assert evicted is not None and evicted.rid == "new-low"  # ties: the newest goes
    unbounded = WaitingQueue(context_len=64, kv_capacity=100, priorities=ON)
    assert unbounded.check(request("any", 0)) is None
    off = WaitingQueue(context_len=64, kv_capacity=100, max_queued=1)
    off.push(request("first", -5))
    with pytest.raises(QueueFullError):
        off.check(request("important", 100))  # without priorities nobody is evicted
