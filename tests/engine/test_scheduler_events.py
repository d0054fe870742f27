"""The scheduler's events (app/engine/scheduling/events.py), recorded over real runs of the
offline Engine: each request admitted, given its first token and finished once; every batch
launched is processed; retractions and preemptions are told, with overlap on and off."""

from __future__ import annotations

from collections import Counter

import pytest

from app.engine import Engine
from app.engine.forward_batch import ForwardMode
from app.engine.request import Request
from app.engine.scheduling.events import EventFanOut, SchedulerEvents
from app.ipc.messages import SamplingParams
from engine_checks import prompts_for

PARAMS = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


class Recorder(SchedulerEvents):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.launched: list[int] = []  # ids of the batches launched, then processed
        self.processed: list[int] = []
        self.prefill_tokens = 0

    def admitted(self, req, now):
        assert now >= req.arrival_time
        self.seen.append(("admitted", req.rid))

    def batch_launched(self, batch, now):
        self.launched.append(id(batch))
        if batch.mode is ForwardMode.EXTEND:
            self.prefill_tokens += sum(batch.extend_lens)

    def batch_processed(self, batch, launched_at, now):
        assert now >= launched_at > 0
        self.processed.append(id(batch))

    def first_token(self, req, now):
        assert len(req.output_ids) == 1
        self.seen.append(("first_token", req.rid))

    def finished(self, req, now):
        assert req.finish is not None
        self.seen.append(("finished", req.rid))

    def retracted(self, req, now, *, preempted):
        self.seen.append(("preempted" if preempted else "retracted", req.rid))


@pytest.fixture(scope="module")
def llama(make_checkpoint):
    return make_checkpoint("llama-tied-llama3")


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_every_request_is_admitted_gets_a_first_token_and_finishes_once(llama, overlap):
    engine = Engine(str(llama), max_total_tokens=4096, kernel_options=f"overlap-schedule={overlap}")
    first, second = Recorder(), Recorder()
    engine.scheduler.events = EventFanOut([first, second])
    prompts = prompts_for(engine.built.model_config.vocab_size, seed=3)[:4]
    engine.generate(input_ids=prompts, sampling_params=PARAMS)
    while engine.scheduler.has_work():  # with overlap a step run ahead may still be in flight
        engine.scheduler.step()
    assert first.seen == second.seen  # the fan-out tells each observer the same
    counts = Counter(first.seen)
    for i in range(4):
        rid = f"offline-{i}"
        assert counts[("admitted", rid)] == counts[("first_token", rid)] == counts[("finished", rid)] == 1
        kinds = [kind for kind, r in first.seen if r == rid]
        assert kinds == ["admitted", "first_token", "finished"]
    assert first.launched == first.processed  # in launch order, each once
    assert first.prefill_tokens == sum(len(p) for p in prompts)


def test_retractions_and_preemptions_are_told(llama):
    engine = Engine(str(llama), max_total_tokens=160, chunked_prefill_size=64, kernel_options="overlap-schedule=off")
    recorder = Recorder()
    engine.scheduler.events = recorder
    prompts = prompts_for(engine.built.model_config.vocab_size, seed=5)[:6]
    engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=30, temperature=0.0,
                                                                       ignore_eos=True))
    retracted = [rid for kind, rid in recorder.seen if kind == "retracted"]
    assert len(retracted) == engine.scheduler.retractions > 0
    for rid in set(retracted):  # admitted again after each retraction
        assert Counter(recorder.seen)[("admitted", rid)] == retracted.count(rid) + 1

    engine = Engine(str(llama), max_total_tokens=4096, max_running_requests=1, enable_priority_scheduling=True,
                    kernel_options="overlap-schedule=off")
    recorder = Recorder()
    scheduler = engine.scheduler
    scheduler.events = recorder
    scheduler.add_request(Request("low", [5, 6, 7, 8], PARAMS, seed=1, priority=0))
    scheduler.step()
    scheduler.step()
    scheduler.add_request(Request("high", [5, 6, 7, 8], PARAMS, seed=1, priority=11))
    while scheduler.has_work():
        scheduler.step()
    assert ("preempted", "low") in recorder.seen
    assert [rid for kind, rid in recorder.seen if kind == "finished"] == ["high", "low"]
