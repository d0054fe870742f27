"""The scheduler actor's defence in depth: a request that slipped past every check before it
(out-of-range numbers, a broken packed prompt) is answered with an error of its own, and the
scheduler goes on serving the others; the KV pool ends clean.

The engine is real (the embedded tiny model); the channel to the detokenizer is an in-memory
stand-in, since only what the loop queues is looked at.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.actors.scheduler import SchedulerLoop
from app.ipc.messages import FinishReason, SamplingParams, TokenizedRequest, TokenOutput, pack_tokens


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    import os

    from app.engine import Engine
    from app.engine.make_checkpoint import default_model_dir

    old = os.environ.get("APP_CACHE_DIR")
    os.environ["APP_CACHE_DIR"] = str(tmp_path_factory.mktemp("app-cache"))
    try:
        engine = Engine(str(default_model_dir()), max_total_tokens=2048)
    finally:
        if old is None:
            del os.environ["APP_CACHE_DIR"]
        else:
            os.environ["APP_CACHE_DIR"] = old
    endpoints = SimpleNamespace(senders={"to_detokenizer": None})
    return SchedulerLoop(engine.built, endpoints)  # type: ignore[arg-type]


def _request(rid: str, sampling: SamplingParams, input_ids: bytes = pack_tokens([5, 6, 7])) -> TokenizedRequest:
    return TokenizedRequest(rid=rid, input_ids=input_ids, sampling=sampling)


def _run_until_finished(loop: SchedulerLoop, rids: set[str]) -> dict[str, TokenOutput]:
    """Step until each of ``rids`` has its final output; returns them by rid."""
    finals: dict[str, TokenOutput] = {}
    for _ in range(200):
        for output in loop.scheduler.step() if loop.scheduler.has_work() else []:
            if output.finish is not None:
                finals[output.rid] = output
        if set(finals) >= rids:
            return finals
    raise AssertionError(f"not finished: {rids - set(finals)}")


BAD = {
    "huge-max": (SamplingParams(max_new_tokens=2**63, ignore_eos=True), "max_new_tokens must be in [0, 2**31 - 1]"),
    "huge-min": (SamplingParams(min_new_tokens=2**63, max_new_tokens=2**64), "max_new_tokens must be in"),
    "nan-temperature": (SamplingParams(temperature=float("nan")), "temperature must be in [0, 100], got nan"),
    "huge-top-k": (SamplingParams(top_k=2**40), "top_k must be -1 (disabled) or in [0, 2**31 - 1]"),
    "huge-seed": (SamplingParams(seed=2**64), "seed must be in [0, 2**63 - 1]"),
    "bias-outside": (SamplingParams(logit_bias=((2**40, 1.0),)), "logit_bias token ids must be in [0, 2**31 - 1]"),
    "stop-outside": (SamplingParams(stop_token_ids=(10**6,)), "stop_token_ids holds 1000000, outside the vocabulary"),
}


def test_a_malformed_request_is_refused_and_the_others_are_served(loop):
    good = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    messages = [_request(rid, sampling) for rid, (sampling, _) in BAD.items()]
    messages.append(_request("broken-prompt", good, input_ids=b"\x01\x02\x03"))  # not whole int32s
    messages.append(_request("good", good))

    for message in messages:
        assert loop.apply(message) is None
    finals = _run_until_finished(loop, {*BAD, "broken-prompt", "good"})

    for rid, (_, why) in BAD.items():
        finish = finals[rid].finish
        assert finish.reason is FinishReason.ABORT and finish.status_code == 400, rid
        assert why in finish.message, (rid, finish.message)
    broken = finals["broken-prompt"].finish
    assert broken.status_code == 400 and "not a multiple of 4" in broken.message
    assert finals["good"].finish.reason is FinishReason.LENGTH
    assert finals["good"].usage.completion_tokens == 4
    usage = loop.scheduler.stats().usage
    assert usage.consistent and usage.used == 0 and usage.locked == 0
    assert list(loop.scheduler.live_requests()) == []


def test_a_step_out_of_device_memory_ends_its_requests_with_503_and_the_scheduler_goes_on(loop):
    """The device runs out of memory in the forward, after the step's KV slots were allocated
    (the fault is put in the model runner, where a real one is raised): the requests of the step
    end with a 503, the slots come back, and the next requests are served."""
    import torch

    from app.actors.step_recovery import OUT_OF_MEMORY_MESSAGE

    good = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    for rid in ("oom-a", "oom-b"):
        loop.apply(_request(rid, good))
    for _ in range(3):  # prefilled, and decoding
        assert all(output.finish is None for output in loop.step())
    runner = loop.scheduler.pipeline.runner

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test's fault)")

    runner.forward = out_of_memory
    try:
        outputs = loop.step()
    finally:
        del runner.forward  # the class's own again
    finals = {output.rid: output.finish for output in outputs if output.finish is not None}
    assert set(finals) == {"oom-a", "oom-b"}
    for finish in finals.values():
        assert finish.reason is FinishReason.ABORT and finish.status_code == 503
        assert finish.message == OUT_OF_MEMORY_MESSAGE
    assert loop.step.failures == {"oom": 1}
    usage = loop.scheduler.stats().usage
    assert usage.consistent and usage.used == 0  # the failed step's slots came back

    loop.apply(_request("after-oom", good))
    after = _run_until_finished(loop, {"after-oom"})["after-oom"]
    assert after.finish.reason is FinishReason.LENGTH and after.usage.completion_tokens == 8
    usage = loop.scheduler.stats().usage
    assert usage.consistent and usage.used == 0 and list(loop.scheduler.live_requests()) == []
