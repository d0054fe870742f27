"""Request timeouts: the deadlines on their own (no model), then the offline Engine's scheduler
aborting a queued and a decoding request with 503 and its KV back in the pool. The served
version (status codes, SSE) is tests/e2e/test_timeouts_server.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import trio

from app.actors.scheduler import SchedulerLoop
from app.engine import Engine
from app.engine.request import Request, Status
from app.engine.scheduling.deadlines import Deadlines
from app.ipc.messages import FinishReason, SamplingParams, TokenOutput, unpack_tokens
from engine_checks import assert_pool_clean

LONG = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)


def request(rid: str, arrival: float, **params) -> Request:  # noqa: ANN003
    return Request(rid, [1, 2, 3], SamplingParams(**params), seed=1, arrival_time=arrival)


def test_no_timeout_anywhere_leaves_the_heap_empty():
    deadlines = Deadlines(waiting_timeout=None, request_timeout=None)
    deadlines.track(request("a", 100.0))
    assert deadlines.heap == [] and deadlines.nearest() is None
    assert deadlines.expired(1e12) == []


def test_a_request_timeout_is_capped_by_the_server_and_counts_from_arrival():
    deadlines = Deadlines(waiting_timeout=2.0, request_timeout=10.0)
    deadlines.track(request("own", 100.0, timeout=3.0, waiting_timeout=50.0))  # waiting capped to 2
    deadlines.track(request("capped", 100.0, timeout=60.0))  # capped to 10
    assert sorted(entry[0] for entry in deadlines.heap) == [102.0, 102.0, 103.0, 110.0]
    assert deadlines.nearest() == 102.0

    assert deadlines.expired(101.9) == []
    ended = deadlines.expired(102.0)
    assert [(r.rid, m) for r, m in ended] == [
        ("own", "the request waited longer than the waiting timeout (2.0 s)"),
        ("capped", "the request waited longer than the waiting timeout (2.0 s)"),
    ]


def test_the_waiting_deadline_ends_with_the_prefill_and_ended_requests_are_skipped():
    deadlines = Deadlines(waiting_timeout=1.0, request_timeout=None)
    started, retracted, finished = request("started", 100.0), request("retracted", 100.0), request("finished", 100.0)
    running = request("running", 100.0, timeout=5.0)
    for req in (started, retracted, finished, running):
        deadlines.track(req)
    started.status = Status.PREFILLING
    retracted.times_retracted = 1  # back in the queue after its prefill: it has started
    finished.status = Status.FINISHED
    running.status = Status.RUNNING

    assert deadlines.expired(104.0) == []
    ended = deadlines.expired(105.0)
    assert [(r.rid, m) for r, m in ended] == [("running", "the request took longer than the request timeout (5.0 s)")]
    assert deadlines.heap == []


def test_both_deadlines_at_once_abort_a_request_once():
    deadlines = Deadlines(waiting_timeout=1.0, request_timeout=1.0)
    deadlines.track(request("a", 100.0))
    assert [r.rid for r, _ in deadlines.expired(102.0)] == ["a"]


def test_entries_of_ended_requests_are_compacted_away():
    deadlines = Deadlines(waiting_timeout=None, request_timeout=1000.0)
    for i in range(200):
        req = request(f"r{i}", 100.0)
        deadlines.track(req)
        req.status = Status.FINISHED  # ended long before its deadline
    assert len(deadlines.heap) < 70  # compacted whenever it reached 64 entries


# ---------------------------------------------------------------- the offline engine


@pytest.fixture(scope="module")
def llama(make_checkpoint):
    return make_checkpoint("llama-tied-llama3")


def finals(outputs: list[TokenOutput]) -> dict[str, TokenOutput]:
    return {o.rid: o for o in outputs if o.finish is not None}


def test_a_queued_request_past_its_waiting_timeout_is_aborted_with_503(llama):
    engine = Engine(str(llama), max_total_tokens=4096, max_running_requests=1, waiting_timeout=0.2)
    scheduler = engine.scheduler
    scheduler.add_request(Request("running", [1, 2, 3, 4], LONG, seed=1, arrival_time=time.time()))
    scheduler.step()
    scheduler.add_request(Request("queued", [5, 6, 7], LONG, seed=2, arrival_time=time.time()))
    outputs = scheduler.step()
    assert scheduler.stats().waiting == 1 and finals(outputs) == {}
    time.sleep(0.25)
    ended = finals(scheduler.step())
    assert list(ended) == ["queued"]
    finish = ended["queued"].finish
    assert finish.reason is FinishReason.ABORT and finish.status_code == 503
    assert finish.message == "the request waited longer than the waiting timeout (0.2 s)"
    assert scheduler.stats().waiting == 0 and scheduler.stats().running == 1
    assert scheduler.abort("running") == 1
    scheduler.step()
    assert not scheduler.has_work()
    assert_pool_clean(engine)


def test_a_decoding_request_past_its_own_timeout_ends_with_what_it_streamed(llama):
    engine = Engine(str(llama), max_total_tokens=4096, request_timeout=60.0)
    scheduler = engine.scheduler
    params = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True, timeout=0.3)
    scheduler.add_request(Request("short", [1, 2, 3, 4], params, seed=1, stream=True, arrival_time=time.time()))
    scheduler.add_request(Request("free", [1, 2, 3, 4], LONG, seed=1, stream=True, arrival_time=time.time()))
    outputs: list[TokenOutput] = []
    while "short" not in finals(outputs):
        outputs += scheduler.step()
    finish = finals(outputs)["short"].finish
    assert finish.reason is FinishReason.ABORT and finish.status_code == 503
    assert finish.message == "the request took longer than the request timeout (0.3 s)"
    streamed = sum((unpack_tokens(o.token_ids) for o in outputs if o.rid == "short"), [])
    assert 0 < len(streamed) < 400
    assert scheduler.stats().running == 1  # the other request decodes on
    scheduler.abort("free")
    scheduler.step()
    assert_pool_clean(engine)


def test_the_engine_flags_are_validated():
    with pytest.raises(ValueError, match=r"--request-timeout must be in \(0, 86400\] seconds, got 0.0"):
        Engine(None, request_timeout=0.0)
    with pytest.raises(ValueError, match=r"--waiting-timeout must be in \(0, 86400\] seconds"):
        Engine(None, waiting_timeout=-1.0)


def test_the_idle_scheduler_actor_wakes_at_the_nearest_deadline(llama):
    """No message and no step: the actor's sleep ends at the deadline and expires the request,
    whose 503 is then pending for the next step's outputs."""
    engine = Engine(str(llama), max_total_tokens=4096)
    loop = SchedulerLoop(engine.built, SimpleNamespace(senders={"to_detokenizer": None}))  # type: ignore[arg-type]
    arrival = time.time()
    params = SamplingParams(max_new_tokens=4, waiting_timeout=0.2)
    loop.scheduler.add_request(Request("queued", [1, 2, 3], params, seed=1, arrival_time=arrival))

    async def sleep() -> float:
        loop.wake = trio.Event()
        with trio.fail_after(5):
            await loop.sleep()
        return time.time()

    woke = trio.run(sleep)
    assert 0.2 <= woke - arrival < 2.0
    ended = finals(loop.scheduler.step())
    assert ended["queued"].finish.status_code == 503 and loop.scheduler.stats().waiting == 0
    assert_pool_clean(engine)
