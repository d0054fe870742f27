"""Multi-step decode (``--decode-steps N``): a lone greedy request runs N decode steps at once
and gets exactly the tokens, finish reasons and KV bookkeeping of one step at a time.

On a CPU the N steps run eagerly (multi_step.run_steps_eager) through the same scheduler path
as the GPU's one-graph replay, so these tests check the bookkeeping: runs only where allowed
(one greedy request with N tokens to go), stops inside a run, the steps' KV slots given back.
The graph itself is tested on the GPU (tests/engine/test_cuda_graph_gpu.py)."""

from __future__ import annotations

import pytest

from app.engine import Engine
from app.ipc.messages import SamplingParams
from engine_checks import assert_pool_clean, prompts_for


@pytest.fixture(scope="module")
def llama(make_checkpoint):
    return make_checkpoint("llama-tied-llama3")


def greedy(max_new_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **extra)


def outcome(results) -> list[tuple]:
    return [(r.token_ids, r.finish_reason, r.matched, r.completion_tokens) for r in results]


def one_at_a_time(engine: Engine, prompts, params) -> list:
    return [engine.generate(input_ids=[p], sampling_params=q)[0] for p, q in zip(prompts, params)]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_lone_greedy_requests_get_the_tokens_of_single_steps(llama, overlap):
    vocab = 256
    prompts = prompts_for(vocab)[:4]
    lengths = [11, 4, 3, 17]
    params = [greedy(n) for n in lengths]
    single = Engine(str(llama), overlap_schedule=overlap)
    multi = Engine(str(llama), overlap_schedule=overlap, decode_steps=4)
    assert multi.built.decode_steps == 4 and single.built.decode_steps == 1
    expected = one_at_a_time(single, prompts, params)
    got = one_at_a_time(multi, prompts, params)
    assert outcome(got) == outcome(expected)
    assert [len(r.token_ids) for r in got] == lengths
    # After the prefill's token, a request decodes in runs of 4 while 4 or more remain (11: two
    # runs and two single steps; 4: three single steps).
    assert multi.scheduler.runner.step_runs == sum((n - 1) // 4 for n in lengths)
    assert single.scheduler.runner.step_runs == 0
    assert_pool_clean(multi)


def first_new_token_inside_a_run(tokens: list[int], steps: int) -> int | None:
    """The first output position (after the prefill's token, index 0) whose token did not occur
    before and which is not the last of its run of ``steps`` (runs cover 1..steps, ...)."""
    for i in range(2, len(tokens) - steps):
        if tokens[i] not in tokens[:i] and (i - 1) % steps != steps - 1:
            return i
    return None


def test_a_stop_token_inside_a_run_ends_the_request_there(llama):
    single = Engine(str(llama), overlap_schedule=True)
    multi = Engine(str(llama), overlap_schedule=True, decode_steps=4)
    for prompt in prompts_for(256):
        reference = single.generate(input_ids=[prompt], sampling_params=greedy(24))[0].token_ids
        stop_at = first_new_token_inside_a_run(reference, 4)
        if stop_at is not None:
            break
    assert stop_at is not None, "no prompt has a new token inside a run"
    stop = reference[stop_at]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(stop,))
    expected = single.generate(input_ids=[prompt], sampling_params=params)[0]
    got = multi.generate(input_ids=[prompt], sampling_params=params)[0]
    assert outcome([got]) == outcome([expected])
    assert got.token_ids == reference[: stop_at + 1] and got.finish_reason == "stop" and got.matched == stop
    assert multi.scheduler.runner.step_runs >= 1
    assert_pool_clean(multi)


def test_no_runs_for_sampled_or_logprob_requests_or_batches(llama):
    vocab = 256
    prompts = prompts_for(vocab)[:3]
    multi = Engine(str(llama), overlap_schedule=True, decode_steps=4)
    single = Engine(str(llama), overlap_schedule=True)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    with_logprobs = greedy(12, logprobs=True)
    for params in (sampled, with_logprobs):
        assert outcome(multi.generate(input_ids=prompts[:1], sampling_params=params)) == outcome(
            single.generate(input_ids=prompts[:1], sampling_params=params))
    assert multi.scheduler.runner.step_runs == 0
    # Three greedy requests together decode as a batch; the last one left alone runs ahead in steps.
    params = [greedy(5), greedy(6), greedy(20)]
    got = multi.generate(input_ids=prompts, sampling_params=params)
    assert outcome(got) == outcome(single.generate(input_ids=prompts, sampling_params=params))
    assert multi.scheduler.runner.step_runs >= 2
    assert_pool_clean(multi)


def test_the_flag_is_checked(llama):
    with pytest.raises(ValueError, match="--decode-steps must be in 1..64"):
        Engine(str(llama), decode_steps=0)
