"""Overlap scheduling: decode steps queued before the previous step's tokens reach the host, and
prefill steps queued behind the prefill in flight, give exactly the outputs of the plain
schedule, and leave nothing behind.

On a CPU every device op finishes before it returns, so these tests check the bookkeeping
(one step of lag, dropped extra tokens, KV of finished requests, aborts while a step is in
flight) rather than the speed; the GPU runs the same code with asynchronous launches.
"""

from __future__ import annotations

import random

import pytest

from app.engine import Engine
from app.engine.request import Request
from app.ipc.messages import FinishReason, SamplingParams, unpack_tokens
from engine_checks import assert_pool_clean, prompts_for

ON, OFF = "overlap-schedule=on", "overlap-schedule=off"


@pytest.fixture(scope="module")
def llama(make_checkpoint):
    return make_checkpoint("llama-tied-llama3")


def engine_pair(path, **options) -> tuple[Engine, Engine]:
    """The same engine without and with overlap."""
    plain = Engine(str(path), kernel_options=OFF, **options)
    overlapped = Engine(str(path), kernel_options=ON, **options)
    assert not plain.scheduler.overlap and overlapped.scheduler.overlap
    return plain, overlapped


def mixed_params(n: int, seed: int, vocab: int) -> list[SamplingParams]:
    """Greedy and seeded sampling, stop tokens, logprobs, lengths from 1 to 24 tokens."""
    rng = random.Random(seed)
    params = []
    for i in range(n):
        params.append(SamplingParams(
            max_new_tokens=rng.randrange(1, 25),
            temperature=0.0 if i % 2 else 0.9,
            top_p=0.95,
            seed=i,
            stop_token_ids=tuple(rng.randrange(vocab) for _ in range(8)) if i % 3 == 0 else (),
            logprobs=i % 4 == 0,
            top_logprobs=2 if i % 8 == 0 else 0,
        ))  # fmt: skip
    return params


LOGPROB_TOL = 1e-5  # a finished request stays one extra step in the batch: other batch sizes, other rounding


def outcome(results) -> list[tuple]:
    return [(r.token_ids, r.finish_reason, r.matched, r.logprobs is None,
             [t for t, _ in sum(r.top_logprobs or [], [])]) for r in results]


def assert_same_results(expected, got) -> None:
    """Tokens, finishes and top-logprob tokens equal; log-probabilities within LOGPROB_TOL."""
    assert outcome(got) == outcome(expected)
    for a, b in zip(expected, got):
        pairs = list(zip(a.logprobs or [], b.logprobs or []))
        pairs += [(p, q) for ra, rb in zip(a.top_logprobs or [], b.top_logprobs or []) for (_, p), (_, q) in zip(ra, rb)]
        assert all(abs(p - q) <= LOGPROB_TOL for p, q in pairs)


@pytest.mark.parametrize("options", [
    dict(max_total_tokens=4096),  # one prefill step for all
    dict(max_total_tokens=4096, disable_radix_cache=True),
    dict(max_total_tokens=4096, max_prefill_tokens=64),  # several: each queued behind the last
    dict(max_total_tokens=4096, page_size=4, chunked_prefill_size=16),
    dict(max_total_tokens=600, max_prefill_tokens=96, chunked_prefill_size=32),  # tight KV
], ids=["default", "no-radix-cache", "small-steps", "paged-chunked", "tight-kv"])  # fmt: skip
def test_overlap_gives_the_plain_schedules_outputs(llama, options):
    plain, overlapped = engine_pair(llama, **options)
    vocab = plain.built.model_config.vocab_size
    rng = random.Random(3)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 70))] for _ in range(24)]
    params = mixed_params(len(prompts), seed=4, vocab=vocab)
    expected = plain.generate(input_ids=prompts, sampling_params=params)
    got = overlapped.generate(input_ids=prompts, sampling_params=params)
    assert_same_results(expected, got)
    assert any(r.finish_reason == "stop" for r in got) and any(r.finish_reason == "length" for r in got)
    assert any(r.top_logprobs for r in got)
    timing = overlapped.scheduler.timing
    assert timing.overlapped_steps > 0 and plain.scheduler.timing.overlapped_steps == 0
    # Small prefill budgets spread the prompts over several steps, each queued behind the last;
    # otherwise one step takes all 24 prompts.
    small_steps = "max_prefill_tokens" in options or "chunked_prefill_size" in options
    assert (overlapped.scheduler.prefills_ahead > 0) == small_steps and plain.scheduler.prefills_ahead == 0
    assert 0 < timing.device_s <= timing.step_s <= timing.active_s
    # one generate call: the scheduler had work from its first step to its last
    assert timing.active_s <= timing.step_s + 0.5 and timing.as_dict()["device_busy_share"] <= 1.0
    assert_pool_clean(plain)
    assert_pool_clean(overlapped)


def test_overlap_through_retraction_and_the_context_length(llama):
    plain, overlapped = engine_pair(llama, max_total_tokens=160, chunked_prefill_size=64, context_length=72)
    prompts = prompts_for(plain.built.model_config.vocab_size, seed=5)[:6]  # 3..41 tokens
    params = SamplingParams(max_new_tokens=40, max_new_tokens_given=False, temperature=0.0, ignore_eos=True, logprobs=True)
    expected = plain.generate(input_ids=prompts, sampling_params=params)
    got = overlapped.generate(input_ids=prompts, sampling_params=params)
    assert_same_results(expected, got)
    assert overlapped.scheduler.retractions > 0  # the pool cannot hold all six at once
    lengths = [len(p) + len(r.token_ids) for p, r in zip(prompts, got)]
    assert max(lengths) == 72  # the longest prompt ran into the context length
    assert_pool_clean(overlapped)


def test_streamed_tokens_arrive_once_each_one_step_late(llama):
    engine = Engine(str(llama), max_total_tokens=4096, kernel_options=ON)
    scheduler = engine.scheduler
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    scheduler.add_request(Request("s", [1, 2, 3], params, seed=1, stream=True))
    per_step = []
    while scheduler.has_work():
        per_step.append([unpack_tokens(o.token_ids) for o in scheduler.step() if o.rid == "s"])
    # Every step's token comes with the next call, the prefill's too (the first decode step is
    # queued behind the prefill): nothing, then one token per call.
    assert per_step[0] == [] and all(len(step) == 1 and len(step[0]) == 1 for step in per_step[1:7])
    tokens = [t for step in per_step for out in step for t in out]
    plain = Engine(str(llama), max_total_tokens=4096, kernel_options=OFF)
    assert tokens == plain.generate(input_ids=[[1, 2, 3]], sampling_params=params)[0].token_ids
    assert_pool_clean(engine)


def test_abort_while_a_step_is_in_flight(llama):
    engine = Engine(str(llama), max_total_tokens=4096, kernel_options=ON)
    scheduler = engine.scheduler
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    scheduler.add_request(Request("keep", [1, 2, 3, 4], params, seed=1, stream=True))
    scheduler.add_request(Request("drop", [5, 6, 7], params, seed=2, stream=True))
    outputs = []
    for _ in range(5):
        outputs += scheduler.step()
    assert scheduler.pipeline.in_flight is not None  # a decode step is queued and unread
    assert scheduler.abort("drop", "client gone", 499) == 1
    while scheduler.has_work():
        outputs += scheduler.step()
    dropped = [o for o in outputs if o.rid == "drop"]
    assert dropped[-1].finish is not None and dropped[-1].finish.reason is FinishReason.ABORT
    assert sum(o.finish is not None for o in dropped) == 1  # the in-flight token is not reported
    kept = [t for o in outputs if o.rid == "keep" for t in unpack_tokens(o.token_ids)]
    plain = Engine(str(llama), max_total_tokens=4096, kernel_options=OFF)
    assert kept == plain.generate(input_ids=[[1, 2, 3, 4]], sampling_params=params)[0].token_ids
    assert_pool_clean(engine)


def test_decode_runs_ahead_while_requests_leave(llama):
    """Requests finishing at different steps: every decode step is queued ahead (the first
    behind the prefill), the leavers' rows dropped on the device; outputs as the plain
    schedule's."""
    plain, overlapped = engine_pair(llama, max_total_tokens=4096)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0 if n % 2 else 0.8, seed=n, ignore_eos=True)
              for n in (3, 11, 6, 8)]
    expected = plain.generate(input_ids=prompts, sampling_params=params)
    got = overlapped.generate(input_ids=prompts, sampling_params=params)
    assert_same_results(expected, got)
    scheduler = overlapped.scheduler
    while scheduler.has_work():  # the step queued past the last finish
        assert scheduler.step() == []
    decode_steps = scheduler.forward_steps - 1  # one prefill step for all four
    assert decode_steps == 11  # the longest request's 10 decode tokens, and the one dropped
    assert scheduler.timing.overlapped_steps == decode_steps  # the first, behind the prefill, too
    assert_pool_clean(overlapped)


def test_decoding_runs_ahead_while_prompts_wait_for_kv(llama):
    """More prompts than the KV pool holds: while some wait for memory (and requests are
    retracted), the running ones still decode one step ahead instead of every step waiting for
    the last one's tokens; outputs as the plain schedule's, nothing left used. (It was about
    half the steps before: 30 of 61 in this run.)"""
    plain, overlapped = engine_pair(llama, max_total_tokens=1000)
    vocab = plain.built.model_config.vocab_size
    rng = random.Random(3)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(20, 70))] for _ in range(24)]
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    expected = plain.generate(input_ids=prompts, sampling_params=params)
    got = overlapped.generate(input_ids=prompts, sampling_params=params)
    assert_same_results(expected, got)
    scheduler = overlapped.scheduler
    assert scheduler.retractions > 0 and plain.scheduler.forward_steps > 40  # prompts did wait
    assert scheduler.timing.overlapped_steps >= 0.85 * scheduler.forward_steps
    assert_pool_clean(overlapped)


def test_a_prompt_arriving_during_decode_is_queued_behind_the_decode_step(llama):
    engine = Engine(str(llama), max_total_tokens=4096, kernel_options=ON)
    scheduler = engine.scheduler
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    scheduler.add_request(Request("first", [1, 2, 3, 4], params, seed=1, stream=True))
    outputs = []
    for _ in range(3):
        outputs += scheduler.step()
    in_flight = scheduler.pipeline.in_flight
    assert in_flight is not None and [r.rid for r in in_flight.batch.reqs] == ["first"]  # decoding
    scheduler.add_request(Request("second", [9, 8, 7], params, seed=2, stream=True))
    outputs += scheduler.step()
    launched = scheduler.pipeline.in_flight
    assert scheduler.prefills_ahead == 1 and [r.rid for r in launched.batch.reqs] == ["second"]
    while scheduler.has_work():
        outputs += scheduler.step()
    plain = Engine(str(llama), max_total_tokens=4096, kernel_options=OFF)
    for rid, prompt in (("first", [1, 2, 3, 4]), ("second", [9, 8, 7])):
        tokens = [t for o in outputs if o.rid == rid for t in unpack_tokens(o.token_ids)]
        assert tokens == plain.generate(input_ids=[prompt], sampling_params=params)[0].token_ids, rid
    assert_pool_clean(engine)


@pytest.mark.parametrize("victim", ["joiner", "partial"])
def test_abort_while_a_prefill_is_in_flight(llama, victim):
    """A request aborted while its prefill step is queued and unread: its one finish is
    reported, it never decodes, the others are untouched, nothing stays used."""
    engine = Engine(str(llama), max_total_tokens=4096, kernel_options=ON, max_prefill_tokens=40,
                    chunked_prefill_size=24)
    scheduler = engine.scheduler
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    # "joiner" finishes its prompt in the first step; "partial" needs three chunks of 24.
    prompts = {"joiner": [1, 2, 3, 4, 5], "partial": [(7 * i) % 90 + 1 for i in range(60)], "later": [9, 8, 7]}
    for rid, ids in prompts.items():
        scheduler.add_request(Request(rid, ids, params, seed=len(rid), stream=True))
    outputs = scheduler.step()
    in_flight = scheduler.pipeline.in_flight
    assert in_flight is not None and in_flight.batch.reqs[0].rid == "joiner"
    assert scheduler.prefill.partial is not None and scheduler.prefill.partial.rid == "partial"
    assert scheduler.abort(victim, "client gone", 499) == 1
    while scheduler.has_work():
        outputs += scheduler.step()
    assert scheduler.prefills_ahead > 0
    gone = [o for o in outputs if o.rid == victim]
    assert sum(o.finish is not None for o in gone) == 1 and gone[-1].finish.reason is FinishReason.ABORT
    assert all(not unpack_tokens(o.token_ids) for o in gone)  # its prefill token is dropped too
    plain = Engine(str(llama), max_total_tokens=4096, kernel_options=OFF)
    for rid, ids in prompts.items():
        if rid != victim:
            tokens = [t for o in outputs if o.rid == rid for t in unpack_tokens(o.token_ids)]
            assert tokens == plain.generate(input_ids=[ids], sampling_params=params)[0].token_ids, rid
    assert not scheduler.running and not scheduler.requests
    assert_pool_clean(engine)


def drive(engine: Engine, script: dict[int, list[tuple]], vocab: int) -> dict[str, list]:
    """Run a script of arrivals and aborts by step number until the scheduler is idle; every
    output of every request, in order."""
    scheduler = engine.scheduler
    outputs: dict[str, list] = {}
    step = 0
    while step <= max(script) or scheduler.has_work():
        for event in script.get(step, []):
            if event[0] == "add":
                _, rid, prompt, params = event
                scheduler.add_request(Request(rid, prompt, params, seed=int(rid[1:]), stream=True))
            elif event[1] in scheduler.requests:
                scheduler.abort(event[1], "client gone", 499)
        for out in scheduler.step():
            outputs.setdefault(out.rid, []).append(out)
        step += 1
        assert step < 2000, "the scheduler never went idle"
    return outputs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_and_aborts_give_the_plain_outputs(llama, seed):
    """Requests arrive and are aborted at random steps, in tight KV with chunked prefill: every
    request that was not aborted gets the plain schedule's tokens, every aborted one a single
    finish, and nothing stays used."""
    rng = random.Random(seed)
    options = dict(max_total_tokens=rng.choice([400, 800]), chunked_prefill_size=rng.choice([16, 32]),
                   max_prefill_tokens=64, page_size=rng.choice([1, 4]))
    plain, overlapped = engine_pair(llama, **options)
    vocab = plain.built.model_config.vocab_size
    script: dict[int, list[tuple]] = {}
    aborted = set()
    for i in range(30):
        at = rng.randrange(0, 60)
        params = SamplingParams(max_new_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 0.7]),
                                seed=i, ignore_eos=rng.random() < 0.7, logprobs=rng.random() < 0.3)
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(2, 90))]
        script.setdefault(at, []).append(("add", f"r{i}", prompt, params))
        if rng.random() < 0.25:
            aborted.add(f"r{i}")
            script.setdefault(at + rng.randrange(1, 12), []).append(("abort", f"r{i}"))
    got = drive(overlapped, script, vocab)
    want = drive(plain, script, vocab)
    assert set(got) == set(want) == {f"r{i}" for i in range(30)}
    for rid, outs in got.items():
        finishes = [o.finish for o in outs if o.finish is not None]
        assert len(finishes) == 1, rid
        if rid in aborted:
            continue  # where the abort lands differs with overlap
        tokens = [t for o in outs for t in unpack_tokens(o.token_ids)]
        assert tokens == [t for o in want[rid] for t in unpack_tokens(o.token_ids)], rid
        assert finishes[0].reason == [o.finish for o in want[rid] if o.finish is not None][0].reason
    assert overlapped.scheduler.timing.overlapped_steps > 0 and overlapped.scheduler.prefills_ahead > 0
    assert_pool_clean(plain)
    assert_pool_clean(overlapped)


def test_active_time_spans_the_steps_with_work_between_them():
    """active_s counts from each step's start to the next while work remained (the device may
    run between step() calls), and nothing across an idle gap."""
    from app.engine.step_results import StepTiming

    timing = StepTiming()
    timing.record_step(0.0, 1.0, work_left=True)
    timing.record_step(3.0, 3.5, work_left=True)
    timing.record_step(4.0, 4.25, work_left=False)  # the last of a busy spell: its own duration
    timing.record_step(10.0, 10.5, work_left=False)  # after an idle gap: its own duration only
    timing.device_s = 2.375
    assert timing.steps == 4 and timing.step_s == 2.25
    assert timing.active_s == 3.0 + 1.0 + 0.25 + 0.5
    assert timing.as_dict()["device_busy_share"] == 0.5
