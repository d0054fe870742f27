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


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_waiting_request_preempts_a_running_one_only_past_the_threshold(make_checkpoint, overlap):
    """One running slot: a request 10 above the running one waits (the gap must exceed the
    threshold, 10); one 11 above preempts it at once (with overlap, once the step in flight is
    read). The preempted request is recomputed and ends with the tokens it would have had alone."""
    from engine_checks import assert_pool_clean

    from app.engine import Engine
    from app.ipc.messages import unpack_tokens

    engine = Engine(str(make_checkpoint("llama-tied-llama3")), max_total_tokens=4096, max_running_requests=1,
                    enable_priority_scheduling=True, kernel_options=f"overlap-schedule={overlap}")
    assert engine.scheduler.overlap == (overlap == "on")
    scheduler = engine.scheduler
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)

    def add(rid: str, priority: int) -> None:
        scheduler.add_request(Request(rid, [5, 6, 7, 8], params, seed=1, priority=priority))

    outputs = []
    add("low", 0)
    outputs += scheduler.step() + scheduler.step()
    add("within", 10)
    outputs += scheduler.step() + scheduler.step()
    assert [r.rid for r in scheduler.running.reqs] == ["low"] and scheduler.retraction.preemptions == 0
    add("high", 11)
    outputs += scheduler.step()
    assert scheduler.retraction.preemptions == 1 and "low" not in [r.rid for r in scheduler.running.reqs]
    assert [r.rid for r in scheduler.waiting] == ["within", "low"]
    while scheduler.has_work():
        outputs += scheduler.step()
    finals = [o for o in outputs if o.finish is not None]
    assert [o.rid for o in finals] == ["high", "within", "low"]
    tokens = {o.rid: unpack_tokens(o.token_ids) for o in finals}
    assert tokens["low"] == tokens["within"] == tokens["high"] and len(tokens["low"]) == 12  # same prompt, greedy
    assert_pool_clean(engine)


def test_the_offline_engine_gives_its_requests_the_default_priority(make_checkpoint):
    from app.engine import Engine

    engine = Engine(str(make_checkpoint("llama-tied-llama3")), max_total_tokens=256,
                    enable_priority_scheduling=True, default_priority_value=7)
    req = engine._request([5, 6, 7], SamplingParams(max_new_tokens=2))
    assert req.priority == 7
    result = engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert result[0].completion_tokens == 2
