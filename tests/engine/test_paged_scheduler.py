"""The scheduler with KV pages of several slots: same tokens, exact accounting, whole pages.

Requests fill the unused tail of their last page before taking new pages; the prefix cache
keeps whole pages only. Greedy tokens must equal transformers' (the top-2-gap rule) whatever
the page size, with chunked prefill cutting pages in the middle, prefix hits and retraction.
"""

from __future__ import annotations

import pytest
from engine_checks import GREEDY, NEW_TOKENS, assert_pool_clean, check_against_reference, prompts_for

from app.engine import Engine
from app.engine.request import Request
from app.ipc.messages import SamplingParams


@pytest.fixture(scope="module")
def llama(make_checkpoint):
    return make_checkpoint("llama-tied-llama3")


def paged_engine(checkpoint, deferred: bool = False, **options) -> Engine:
    """An engine (on the GPU where there is one); ``deferred``: its allocator frees as on CUDA,
    checking on the device and raising at check() (without reading the device at each free), which
    needs every free to come in runs from a page's first slot."""
    engine = Engine(str(checkpoint), **options)
    allocator = engine.scheduler.memory.allocator
    # each device's own choice unless forced: the switch below is real
    assert allocator.deferred_checks is (allocator.device.type == "cuda")
    allocator.deferred_checks = deferred
    return engine


def assert_whole_pages(engine: Engine) -> None:
    """Free slots come in whole pages, and the pool's three states add up."""
    memory = engine.scheduler.memory
    page = memory.page_size
    usage = engine.scheduler.stats().usage
    assert usage.consistent, usage
    assert usage.free % page == 0 and usage.evictable % page == 0


@pytest.mark.parametrize(("page_size", "chunk", "deferred"),
                         [(4, None, False), (4, 10, False), (16, None, False), (16, 10, False), (16, 10, True)])
def test_greedy_tokens_are_the_same_with_pages(llama, reference_models, page_size, chunk, deferred):
    options = {"chunked_prefill_size": chunk} if chunk else {"chunked_prefill_size": -1}
    engine = paged_engine(llama, deferred, max_total_tokens=4096, page_size=page_size, **options)
    prompts = prompts_for(engine.built.model_config.vocab_size)
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    reference = reference_models(llama)
    for prompt, result in zip(prompts, results):
        assert result.completion_tokens == NEW_TOKENS
        check_against_reference(reference, prompt, result)
    assert_whole_pages(engine)
    assert_pool_clean(engine)


@pytest.mark.parametrize("deferred", [False, True])
def test_prefix_hits_are_whole_pages(llama, reference_models, deferred):
    engine = paged_engine(llama, deferred, max_total_tokens=4096, page_size=8)
    prompt = prompts_for(engine.built.model_config.vocab_size)[6]  # 58 tokens
    first = engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0]
    again = engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0]
    assert first.cached_tokens == 0
    assert again.cached_tokens == (len(prompt) - 1) // 8 * 8  # 56: the whole pages of prompt[:-1]
    assert again.token_ids == first.token_ids
    check_against_reference(reference_models(llama), prompt, again)
    assert_pool_clean(engine)


@pytest.mark.parametrize("deferred", [False, True])
def test_retraction_with_pages_keeps_tokens_and_accounting(llama, reference_models, deferred):
    engine = paged_engine(llama, deferred, max_total_tokens=192, page_size=8, chunked_prefill_size=32)
    prompts = prompts_for(engine.built.model_config.vocab_size, seed=5)[:6]
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, logprobs=True)
    results = engine.generate(input_ids=prompts, sampling_params=params)
    assert engine.scheduler.retractions > 0
    for prompt, result in zip(prompts, results):
        assert result.completion_tokens == 30
        check_against_reference(reference_models(llama), prompt, result)
    assert_pool_clean(engine)


def test_pages_are_accounted_while_requests_run(llama):
    """Mid-flight, a request holds whole pages: used is a multiple of the page size."""
    engine = Engine(str(llama), max_total_tokens=1024, page_size=4)
    scheduler = engine.scheduler
    params = SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
    scheduler.add_request(Request("a", list(range(1, 8)), params, seed=1))  # 7 tokens: 2 pages
    scheduler.add_request(Request("b", list(range(1, 4)), params, seed=2))  # 3 tokens: 1 page
    while scheduler.has_work():
        scheduler.step()
        usage = scheduler.stats().usage
        assert usage.consistent and usage.used % 4 == 0, usage
    assert_pool_clean(engine)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_step_whose_forward_fails_gives_its_fresh_pages_back(llama, deferred):
    """The device runs out of memory in the forward of a decode step where one request grows
    into its last page's tail and one needs a new page (the fault is put in the model runner):
    the new pages come back whole, the tail stays its owner's, and the pool adds up after the
    requests are ended (app/actors/step_recovery.py does this in the server)."""
    import torch

    engine = paged_engine(llama, deferred, max_total_tokens=4096, page_size=4, chunked_prefill_size=-1)
    scheduler = engine.scheduler
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    scheduler.add_request(Request("tail", list(range(1, 7)), params, seed=1))  # KV 6 long: the 7th fits the tail
    scheduler.add_request(Request("page", list(range(1, 9)), params, seed=2))  # KV 8 long: the 9th needs a page
    scheduler.step()  # both prefilled: each has its first token, which the next step's KV holds
    free_before = scheduler.memory.allocator.num_free()
    runner = scheduler.pipeline.runner

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. (a test's fault)")

    runner.forward = out_of_memory
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            scheduler.step()
    finally:
        del runner.forward
    assert scheduler.memory.allocator.num_free() == free_before  # the decode step's new page came back
    ended = scheduler.fail_admitted("out of memory", 503)
    assert {req.rid for req in ended} == {"tail", "page"}
    finals = {output.rid: output.finish for output in scheduler.outputs.take()}
    assert {rid: (f.reason.value, f.status_code) for rid, f in finals.items()} == {
        "tail": ("abort", 503), "page": ("abort", 503)}
    scheduler.add_request(Request("after", list(range(1, 5)), params, seed=3))
    while scheduler.has_work():
        scheduler.step()
    assert_whole_pages(engine)
    assert_pool_clean(engine)
