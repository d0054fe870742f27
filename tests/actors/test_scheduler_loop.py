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
