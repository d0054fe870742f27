"""The scheduler's metrics on a real engine (the embedded tiny model, in this process): its events
give the queue times and step times, its state the gauges, which fall to 0 once it is idle."""

from __future__ import annotations

import os
import time

import pytest
import trio

from app.engine.request import Request
from app.engine.sampling import request_seed
from app.engine.scheduling.events import SchedulerEvents
from app.ipc.messages import MetricsSnapshot, SamplingParams
from app.observability.scheduler_metrics import scheduler_metrics


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from app.engine import Engine
    from app.engine.make_checkpoint import default_model_dir

    old = os.environ.get("APP_CACHE_DIR")
    os.environ["APP_CACHE_DIR"] = str(tmp_path_factory.mktemp("app-cache"))
    try:
        return Engine(str(default_model_dir()), max_total_tokens=2048)
    finally:
        if old is None:
            del os.environ["APP_CACHE_DIR"]
        else:
            os.environ["APP_CACHE_DIR"] = old


class Admissions(SchedulerEvents):
    """Another observer, as the request logs or the traces are."""

    def __init__(self) -> None:
        self.rids: list[str] = []

    def admitted(self, req: Request, now: float) -> None:
        self.rids.append(req.rid)


def values(snapshot: MetricsSnapshot) -> dict[str, float]:
    """Unlabelled samples by name."""
    return {s.name: s.value for f in snapshot.families for s in f.samples if not s.labels}


def test_events_and_state_become_metrics_and_the_gauges_fall_to_zero_when_idle(engine):
    scheduler = engine.built.scheduler
    other = Admissions()
    scheduler.events = other
    observer = scheduler_metrics(scheduler)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0)
    for i in range(2):
        request = Request(f"m{i}", [5, 6, 7, 8 + i], params, request_seed(params), arrival_time=time.time())
        scheduler.add_request(request)
    queued = values(observer.snapshot())
    assert queued["app:num_queue_reqs"] == 2 and queued["app:num_running_reqs"] == 0
    scheduler.step()
    busy = values(observer.snapshot())
    assert busy["app:num_running_reqs"] == 2 and busy["app:num_queue_reqs"] == 0
    assert busy["app:num_used_tokens"] > 0 and busy["app:token_usage"] == busy["app:num_used_tokens"] / 2048
    assert busy["app:full_token_usage"] == busy["app:token_usage"]
    assert 0 < busy["app:pending_prealloc_token_usage"] < 1  # 7 tokens each still to come, partly reserved
    assert busy["app:max_total_num_tokens"] == 2048
    while scheduler.has_work():
        scheduler.step()
    done = values(observer.snapshot())
    assert done["app:queue_time_seconds_count"] == 2
    assert done["app:prefill_time_seconds_count"] >= 1
    assert done["app:decode_time_seconds_count"] >= 7  # 8 tokens each: the first from the prefill
    assert done["app:gen_throughput"] > 0  # tokens sampled since the previous snapshot
    assert done["app:num_preempted_requests_total"] == 0
    assert other.rids == ["m0", "m1"]  # the observer that was there still hears the events

    sent: list[MetricsSnapshot] = []

    async def send(snapshot: MetricsSnapshot) -> None:
        sent.append(snapshot)

    async def idle() -> None:
        await observer.went_idle(send)
        await observer.went_idle(send)  # nothing changed: nothing sent

    trio.run(idle)
    assert len(sent) == 1
    rest = values(sent[0])
    for gauge in ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "token_usage", "full_token_usage",
                  "pending_prealloc_token_usage", "swa_token_usage", "mamba_usage", "gen_throughput"):
        assert rest[f"app:{gauge}"] == 0, gauge
