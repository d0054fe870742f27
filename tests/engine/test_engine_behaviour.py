"""Engine behaviour beyond greedy equality: seeds, stops, retraction, limits, aborts.

Every test ends with the pool check: nothing used or locked, and all free after a flush.
"""

from __future__ import annotations

import pytest

from app.engine import Engine
from app.engine.request import Request
from app.engine.scheduling import AdmissionError, QueueFullError
from app.ipc.messages import FinishReason, SamplingParams, unpack_tokens
from engine_checks import GREEDY, assert_pool_clean, check_against_reference, prompts_for


@pytest.fixture(scope="module")
def llama(make_checkpoint):
    return make_checkpoint("llama-tied-llama3")


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The embedded tiny model (with its real tokenizer), in a private cache directory."""
    import os

    from app.engine.make_checkpoint import default_model_dir

    old = os.environ.get("APP_CACHE_DIR")
    os.environ["APP_CACHE_DIR"] = str(tmp_path_factory.mktemp("app-cache"))
    try:
        return Engine(str(default_model_dir()), max_total_tokens=4096)
    finally:
        if old is None:
            del os.environ["APP_CACHE_DIR"]
        else:
            os.environ["APP_CACHE_DIR"] = old


def test_seeded_sampling_repeats_whatever_shares_the_batch(llama):
    engine = Engine(str(llama), max_total_tokens=4096)
    prompts = prompts_for(engine.built.model_config.vocab_size)
    seeded = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate(input_ids=[prompts[2]], sampling_params=seeded)[0]
    others = [SamplingParams(max_new_tokens=5 + i, temperature=0.7, seed=i, ignore_eos=True) for i in range(4)]
    mixed = engine.generate(input_ids=prompts[:2] + [prompts[2]] + prompts[3:5], sampling_params=others[:2] + [seeded] + others[2:])
    assert mixed[2].token_ids == alone.token_ids
    unseeded = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    a, b = engine.generate(input_ids=[prompts[2]] * 2, sampling_params=unseeded)
    assert a.token_ids != b.token_ids  # different random streams without a seed
    assert_pool_clean(engine)


def test_top_k_one_equals_greedy(llama):
    engine = Engine(str(llama), max_total_tokens=4096)
    prompts = prompts_for(engine.built.model_config.vocab_size)[:4]
    greedy = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    top1 = engine.generate(input_ids=prompts, sampling_params=SamplingParams(
        max_new_tokens=GREEDY.max_new_tokens, temperature=1.3, top_k=1, ignore_eos=True, seed=3))
    assert [r.token_ids for r in top1] == [r.token_ids for r in greedy]
    assert_pool_clean(engine)


def test_a_full_pool_retracts_and_recomputes_without_changing_tokens(llama, reference_models):
    engine = Engine(str(llama), max_total_tokens=160, chunked_prefill_size=64)
    prompts = prompts_for(engine.built.model_config.vocab_size, seed=5)[:6]  # 3..41 tokens
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, logprobs=True)
    results = engine.generate(input_ids=prompts, sampling_params=params)
    assert engine.scheduler.retractions > 0  # the pool cannot hold all six at once
    assert engine.scheduler.reserve.reset_at > 0  # a retraction set the admission reserve back
    reference = reference_models(llama)
    for prompt, result in zip(prompts, results):
        assert result.completion_tokens == 30
        check_against_reference(reference, prompt, result)
    assert_pool_clean(engine)


def test_stop_token_ids_end_a_request_and_min_new_tokens_delays_them(llama):
    engine = Engine(str(llama), max_total_tokens=4096)
    prompt = prompts_for(engine.built.model_config.vocab_size)[3]
    free_run = engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0].token_ids
    stop = free_run[3]
    first = free_run.index(stop)
    stopped = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
        max_new_tokens=10, temperature=0.0, stop_token_ids=(stop,)))[0]
    assert stopped.token_ids == free_run[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.matched == stop
    delayed = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
        max_new_tokens=10, min_new_tokens=first + 2, temperature=0.0, stop_token_ids=(stop,)))[0]
    assert len(delayed.token_ids) >= first + 2
    assert stop not in delayed.token_ids[: first + 2]  # masked until min_new_tokens were generated
    assert delayed.token_ids[:first] == free_run[:first]  # greedy, the same up to where it was masked
    assert_pool_clean(engine)


def test_stop_strings_trim_the_text_and_report_the_match(embedded):
    prompt = "The quick brown fox"
    free = embedded.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert len(free.text) > 12
    stop = free.text[6:9]
    cut = free.text.index(stop)
    result = embedded.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop, "\x00never")))[0]
    assert result.text == free.text[:cut]
    assert result.finish_reason == "stop" and result.matched == stop
    assert result.completion_tokens < free.completion_tokens
    assert_pool_clean(embedded)


def test_text_round_trips_through_the_embedded_tokenizer(embedded):
    result = embedded.generate("Grüße, 世界! 🙂", SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert result.prompt_tokens == len(embedded.tokenizer.encode("Grüße, 世界! 🙂"))
    assert result.text == embedded.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_nothing_to_generate_finishes_at_once(llama):
    engine = Engine(str(llama), max_total_tokens=4096)
    result = engine.generate(input_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_new_tokens=0))[0]
    assert result.token_ids == [] and result.finish_reason == "length" and result.prompt_tokens == 3
    assert engine.scheduler.forward_steps == 0


def test_requests_that_can_never_run_are_refused_with_both_sizes(llama):
    engine = Engine(str(llama), max_total_tokens=4096, context_length=64)
    with pytest.raises(AdmissionError, match=r"The input \(64 tokens\) is longer than the model's context length \(64 tokens\)"):
        engine.generate(input_ids=[[1] * 64], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(input_ids=[[1]], sampling_params=SamplingParams(temperature=-1.0))
    assert_pool_clean(engine)


def test_asking_past_the_context_is_refused_unless_truncation_is_allowed(llama):
    """prompt + max_new_tokens over the context: refused naming both numbers; without a
    max_new_tokens of its own, or with --allow-auto-truncate, cut at the context."""
    asked = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)
    engine = Engine(str(llama), max_total_tokens=4096, context_length=40)
    with pytest.raises(AdmissionError, match=r"maximum context length is 40 tokens\. However, you requested 80 tokens "
                                             r"\(30 in the prompt, 50 for the completion\)"):
        engine.generate(input_ids=[[5] * 30], sampling_params=asked)
    left_out = SamplingParams(max_new_tokens=50, max_new_tokens_given=False, temperature=0.0, ignore_eos=True)
    truncating = Engine(str(llama), max_total_tokens=4096, context_length=40, allow_auto_truncate=True)
    for eng, params in ((engine, left_out), (truncating, asked)):
        result = eng.generate(input_ids=[[5] * 30], sampling_params=params)[0]
        assert result.finish_reason == "length"
        assert result.prompt_tokens == 30 and result.completion_tokens == 10
        assert_pool_clean(eng)


def test_a_refused_call_queues_none_of_its_prompts(llama):
    """One prompt past the context, or more prompts than --max-queued-requests lets wait: the
    call raises before queueing any, and the next call is served alone."""
    engine = Engine(str(llama), max_total_tokens=4096, context_length=40, max_queued_requests=2)
    fits, over = SamplingParams(max_new_tokens=4, temperature=0.0), SamplingParams(max_new_tokens=50)
    with pytest.raises(AdmissionError, match="maximum context length is 40 tokens"):
        engine.generate(input_ids=[[5] * 3, [5] * 3], sampling_params=[fits, over])
    with pytest.raises(QueueFullError, match=r"^The request queue is full\.$"):
        engine.generate(input_ids=[[5] * 3] * 3, sampling_params=fits)
    assert len(engine.scheduler.waiting) == 0 and not engine.scheduler.requests
    results = engine.generate(input_ids=[[5] * 3] * 2, sampling_params=fits)
    assert [r.completion_tokens for r in results] == [4, 4]
    assert_pool_clean(engine)


def test_abort_ends_waiting_and_running_requests_with_a_final_output(llama):
    engine = Engine(str(llama), max_total_tokens=4096, max_running_requests=1)
    scheduler = engine.scheduler
    params = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)
    scheduler.add_request(Request("running", [1, 2, 3, 4], params, seed=1, stream=True))
    scheduler.add_request(Request("queued", [5, 6, 7], params, seed=2))
    outputs = scheduler.step() + scheduler.step()
    assert {o.rid for o in outputs} == {"running"} and scheduler.stats().waiting == 1
    assert scheduler.abort("queued", "client gone", 499) == 1
    assert scheduler.abort("running", "client gone", 499) == 1
    assert scheduler.abort("nonexistent") == 0
    finals = [o for o in scheduler.step() if o.finish is not None]
    assert sorted(o.rid for o in finals) == ["queued", "running"]
    assert all(o.finish.reason is FinishReason.ABORT and o.finish.status_code == 499 for o in finals)
    assert not scheduler.has_work()
    assert_pool_clean(engine)


def test_non_streaming_requests_get_one_output_streaming_ones_get_each_step(llama):
    engine = Engine(str(llama), max_total_tokens=4096)
    scheduler = engine.scheduler
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    scheduler.add_request(Request("s", [1, 2, 3], params, seed=1, stream=True))
    scheduler.add_request(Request("n", [1, 2, 3], params, seed=1, stream=False))
    outputs = []
    while scheduler.has_work():
        outputs += scheduler.step()
    streamed = [o for o in outputs if o.rid == "s"]
    whole = [o for o in outputs if o.rid == "n"]
    assert len(streamed) == 4 and len(whole) == 1
    assert sum((unpack_tokens(o.token_ids) for o in streamed), []) == unpack_tokens(whole[0].token_ids)
    assert streamed[0].usage is not None and streamed[-1].usage.completion_tokens == 4
    assert_pool_clean(engine)


def test_a_lone_request_outgrowing_the_pool_ends_with_length_and_keeps_its_output(llama):
    """A 10-token prompt asking for 80 tokens in a 48-slot pool: it ends when the pool is full
    with finish reason length, a warning, and every token it generated (the same as a roomy
    pool's first ones); streamed, every token reaches the client too."""
    from structlog.testing import capture_logs

    params = SamplingParams(max_new_tokens=80, temperature=0.0, ignore_eos=True)
    prompt = [7, 3, 11, 5, 2, 9, 4, 8, 6, 1]
    roomy = Engine(str(llama), max_total_tokens=4096).generate(input_ids=[prompt], sampling_params=params)[0]
    engine = Engine(str(llama), max_total_tokens=48)
    with capture_logs() as logs:
        cut = engine.generate(input_ids=[prompt], sampling_params=params)[0]
    assert cut.finish_reason == "length"
    assert cut.completion_tokens == len(cut.token_ids) == 48 - len(prompt) + 1  # the last token needs no slot
    assert cut.token_ids == roomy.token_ids[: len(cut.token_ids)]
    warnings = [e for e in logs if e["log_level"] == "warning" and "outgrew the KV cache" in e["event"]]
    assert len(warnings) == 1 and warnings[0]["generated"] == len(cut.token_ids)
    assert_pool_clean(engine)
    scheduler = engine.scheduler
    scheduler.add_request(Request("streamed", prompt, params, seed=1, stream=True))
    outputs = []
    while scheduler.has_work():
        outputs += scheduler.step()
    assert sum((unpack_tokens(o.token_ids) for o in outputs), []) == cut.token_ids
    assert outputs[-1].finish.reason is FinishReason.LENGTH and outputs[-1].finish.status_code is None
    assert_pool_clean(engine)
