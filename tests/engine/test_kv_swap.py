"""--enable-kv-swap: a retracted request's KV goes to host memory and comes back when it resumes.

An offline Engine whose KV pool is too small for its batch retracts requests; with swap their
greedy output must equal an unpreempted run's (a pool large enough for all), at least one
request must have been swapped out and back, and at the end the host pool is empty and the
device pool all free. A host pool too small for any request falls back to recompute with the
same outputs. Overlap on and off; on a GPU the same in bf16.
"""

from __future__ import annotations

import pytest
import torch

from app.engine import Engine
from app.engine.request import Request
from app.ipc.messages import SamplingParams, unpack_tokens
from engine_checks import assert_pool_clean, prompts_for
from greedy_rule import compare_greedy

ON, OFF = "overlap-schedule=on", "overlap-schedule=off"
PARAMS = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def llama(make_checkpoint):
    return make_checkpoint("llama-tied-llama3")


@pytest.fixture(scope="module")
def prompts(llama) -> list[list[int]]:
    return prompts_for(Engine(str(llama), max_total_tokens=64).built.model_config.vocab_size, seed=5)[:6]


@pytest.fixture(scope="module")
def unpreempted(llama, prompts) -> list[list[int]]:
    """Every request's greedy tokens from a pool that holds the whole batch."""
    engine = Engine(str(llama), max_total_tokens=4096, kernel_options=OFF)
    results = engine.generate(input_ids=prompts, sampling_params=PARAMS)
    assert engine.scheduler.retractions == 0
    return [r.token_ids for r in results]


def assert_swap_clean(engine: Engine) -> None:
    swap = engine.scheduler.swap
    assert swap is not None and len(swap) == 0 and swap.used == 0
    assert_pool_clean(engine)


@pytest.mark.parametrize("overlap", [OFF, ON])
@pytest.mark.parametrize("page_size", [1, 8])
def test_swapped_requests_resume_with_the_unpreempted_output(llama, prompts, unpreempted, overlap, page_size):
    engine = Engine(str(llama), max_total_tokens=160 if page_size == 1 else 192, page_size=page_size,
                    chunked_prefill_size=64, kernel_options=overlap, enable_kv_swap=True)
    results = engine.generate(input_ids=prompts, sampling_params=PARAMS)
    swap = engine.scheduler.swap
    assert swap is not None and swap.capacity == engine.built.max_total_tokens  # the default: the device pool's size
    assert engine.scheduler.retractions > 0  # the pool cannot hold all six at once
    assert swap.swapped_out > 0 and swap.swapped_in == swap.swapped_out and swap.fallbacks == 0
    assert [r.token_ids for r in results] == unpreempted
    assert all(r.completion_tokens == 30 for r in results)
    figures = swap.figures()  # as /server_info shows them
    assert figures["used_tokens"] == figures["requests"] == 0 and figures["swapped_in"] == swap.swapped_out
    assert_swap_clean(engine)


@pytest.mark.parametrize("overlap", [OFF, ON])
def test_a_host_pool_too_small_falls_back_to_recompute(llama, prompts, unpreempted, overlap):
    engine = Engine(str(llama), max_total_tokens=160, chunked_prefill_size=64, kernel_options=overlap,
                    enable_kv_swap=True, host_kv_pool_tokens=2)  # smaller than any victim's KV
    results = engine.generate(input_ids=prompts, sampling_params=PARAMS)
    swap = engine.scheduler.swap
    assert swap is not None and engine.scheduler.retractions > 0
    assert swap.swapped_out == 0 and swap.fallbacks == engine.scheduler.retractions
    assert [r.token_ids for r in results] == unpreempted
    assert_swap_clean(engine)


@pytest.mark.parametrize("overlap", [OFF, ON])
def test_a_request_preempted_by_priority_resumes_from_its_host_copy(llama, overlap):
    """One running slot: a request more important by more than the threshold preempts the
    running one, whose KV goes to the host and comes back; it ends with the tokens it would
    have had alone (the same prompt, greedy)."""
    engine = Engine(str(llama), max_total_tokens=4096, max_running_requests=1, enable_priority_scheduling=True,
                    kernel_options=overlap, enable_kv_swap=True)
    scheduler = engine.scheduler
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    scheduler.add_request(Request("low", [5, 6, 7, 8], params, seed=1, priority=0))
    outputs = scheduler.step() + scheduler.step() + scheduler.step()
    scheduler.add_request(Request("high", [5, 6, 7, 8], params, seed=1, priority=11))
    while scheduler.has_work():
        outputs += scheduler.step()
    swap = scheduler.swap
    assert swap is not None and scheduler.retraction.preemptions == 1
    assert swap.swapped_out == swap.swapped_in == 1 and swap.fallbacks == 0
    finals = {o.rid: unpack_tokens(o.token_ids) for o in outputs if o.finish is not None}
    assert finals["low"] == finals["high"] and len(finals["low"]) == 12
    assert_swap_clean(engine)


def test_a_swapped_out_request_aborted_while_waiting_frees_its_host_copy(llama, prompts):
    engine = Engine(str(llama), max_total_tokens=160, chunked_prefill_size=64, kernel_options=OFF,
                    enable_kv_swap=True)
    scheduler = engine.scheduler
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", prompt, PARAMS, seed=1))
    swap = scheduler.swap
    assert swap is not None
    while len(swap) == 0:
        assert scheduler.has_work()
        scheduler.step()
    assert swap.used > 0
    assert scheduler.abort(None) == len(prompts)
    while scheduler.has_work():
        scheduler.step()
    assert swap.swapped_in < swap.swapped_out  # some never came back
    assert_swap_clean(engine)


def test_swap_is_off_by_default_and_the_host_pool_size_is_validated(llama):
    assert Engine(str(llama), max_total_tokens=64).scheduler.swap is None
    with pytest.raises(ValueError, match="--host-kv-pool-tokens must be at least 1, got 0"):
        Engine(str(llama), max_total_tokens=64, enable_kv_swap=True, host_kv_pool_tokens=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("overlap", [OFF, ON])
def test_swap_on_cuda_resumes_with_the_unpreempted_output(llama, prompts, overlap):
    """float32 on CUDA, through the GPU's kernels and its pinned host pool: a resumed request's
    last token is computed by a prefill kernel where the unpreempted run decodes it, so tokens
    are compared up to each request's first near tie (top-2 gap under 1e-3) in the unpreempted
    run. (In bf16 a random-weight model has near ties of 0.1 within a few tokens, which leaves
    too little to compare; the copy itself moves bytes, whatever the dtype.)"""
    common = dict(device="cuda", dtype="float32", chunked_prefill_size=64, kernel_options=overlap)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    reference = Engine(str(llama), max_total_tokens=4096, **common).generate(input_ids=prompts, sampling_params=params)
    engine = Engine(str(llama), max_total_tokens=160, enable_kv_swap=True, **common)
    results = engine.generate(input_ids=prompts, sampling_params=params)
    swap = engine.scheduler.swap
    assert swap is not None and swap.swapped_out > 0 and swap.swapped_in == swap.swapped_out
    assert swap.fallbacks == 0
    assert all(len(have.token_ids) == 30 for have in results)
    compared, _ = compare_greedy(reference, results, tol=1e-3)
    assert compared >= 150, compared  # of 180: near ties of 1e-3 are rare in float32
    assert_swap_clean(engine)
