"""The offline Engine against transformers: greedy tokens under the top-2-gap rule.

The rule is in engine_checks.py.
"""

from __future__ import annotations

import pytest
from engine_checks import GREEDY, NEW_TOKENS, TOL, assert_pool_clean, check_against_reference, prompts_for

from app.engine import Engine

@pytest.mark.parametrize("mode", ["batched", "one_at_a_time", "chunked_16", "no_radix_cache"])
def test_greedy_matches_transformers(checkpoint, reference_models, mode):
    options = {"chunked_16": dict(chunked_prefill_size=16),  # several prompts longer than a chunk at once
               "no_radix_cache": dict(disable_radix_cache=True)}.get(mode, {})
    engine = Engine(str(checkpoint), max_total_tokens=4096, **options)
    prompts = prompts_for(engine.built.model_config.vocab_size)
    if mode == "one_at_a_time":
        results = [engine.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in prompts]
    else:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    reference = reference_models(checkpoint)
    skipped = 0
    for prompt, result in zip(prompts, results):
        assert result.finish_reason == "length" and result.completion_tokens == NEW_TOKENS
        assert result.prompt_tokens == len(prompt)
        skipped += check_against_reference(reference, prompt, result)
    print(f"{checkpoint.name} {mode}: {skipped} of {NEW_TOKENS * len(prompts)} positions skipped (top-2 gap < {TOL})")
    assert skipped <= NEW_TOKENS * len(prompts) // 10  # rare, as it should be
    assert_pool_clean(engine)


def test_prefix_cache_hits_give_the_same_tokens(checkpoint, reference_models):
    engine = Engine(str(checkpoint), max_total_tokens=4096)
    vocab = engine.built.model_config.vocab_size
    prompts = prompts_for(vocab, seed=11)
    first = engine.generate(input_ids=prompts[4:6], sampling_params=GREEDY)
    again = engine.generate(input_ids=prompts[4:6], sampling_params=GREEDY)
    assert [r.cached_tokens for r in first] == [0, 0]
    # The whole prompt but its last token is served from the cache the second time.
    assert [r.cached_tokens for r in again] == [len(p) - 1 for p in prompts[4:6]]
    shared = prompts[6][:40]
    branches = [shared + [3, 4, 5], shared + [6], shared + [7, 8]]
    results = engine.generate(input_ids=branches[:1], sampling_params=GREEDY)
    results += engine.generate(input_ids=branches[1:], sampling_params=GREEDY)
    assert [r.cached_tokens for r in results] == [0, 40, 40]  # the shared prefix, computed once
    reference = reference_models(checkpoint)
    for prompt, result in zip(prompts[4:6] + prompts[4:6] + branches, first + again + results):
        check_against_reference(reference, prompt, result)
    for a, b in zip(first, again):
        assert a.token_ids == b.token_ids
    assert_pool_clean(engine)
