"""The offline Engine against transformers: greedy tokens under the top-2-gap rule.

The rule (one for every greedy-equality test): our tokens are teacher-forced through
transformers; at each output position where transformers' top-2 logit gap is at least TOL,
its argmax must equal our token; positions closer than that are skipped (and counted). Our
raw log-probabilities of the chosen tokens must match transformers' within TOL too.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from app.engine import Engine
from app.ipc.messages import SamplingParams

TOL = 1e-3
NEW_TOKENS = 10


def prompts_for(vocab: int, seed: int = 7) -> list[list[int]]:
    """8 prompts of different lengths (3..70 tokens) of random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (3, 9, 17, 24, 33, 41, 58, 70)]


@pytest.fixture(scope="module")
def reference_models():
    """transformers models per checkpoint path, loaded once."""
    from transformers import AutoModelForCausalLM

    cache: dict[Path, object] = {}

    def get(path: Path):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get


def check_against_reference(reference, prompt: list[int], result) -> int:
    """Assert the top-2-gap rule for one result; return how many positions were skipped."""
    full = torch.tensor([prompt + result.token_ids])
    with torch.no_grad():
        logits = reference(full).logits[0].float()
    out_logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(result.token_ids)]
    top2 = out_logits.topk(2, dim=-1)
    gaps = (top2.values[:, 0] - top2.values[:, 1]).tolist()
    ref_argmax = top2.indices[:, 0].tolist()
    ref_logprobs = torch.log_softmax(out_logits, dim=-1)
    skipped = 0
    for i, token in enumerate(result.token_ids):
        if gaps[i] < TOL:
            skipped += 1
            continue
        assert token == ref_argmax[i], f"position {i}: ours {token}, transformers {ref_argmax[i]} (gap {gaps[i]:.2e})"
        assert abs(result.logprobs[i] - ref_logprobs[i, token].item()) < TOL
    return skipped


def assert_pool_clean(engine: Engine) -> None:
    """Nothing used or locked once every request finished; after a flush, all of it free."""
    usage = engine.scheduler.stats().usage
    assert usage.consistent, usage
    assert usage.used == 0 and usage.locked == 0, usage
    engine.scheduler.memory.cache.check()
    assert engine.scheduler.memory.flush_cache()
    usage = engine.scheduler.stats().usage
    assert usage.free == usage.total, usage


GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)


@pytest.mark.parametrize("mode", ["batched", "one_at_a_time", "chunked_16", "no_radix_cache"])
def test_greedy_matches_transformers(checkpoint, reference_models, mode):
    options = {"chunked_16": dict(chunked_prefill_size=16, max_prefill_tokens=16),
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
