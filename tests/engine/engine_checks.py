"""Shared checks for engine tests: the top-2-gap rule against transformers, and the pool check.

The rule (one for every greedy-equality test): our tokens are teacher-forced through
transformers; at each output position where transformers' top-2 logit gap is at least TOL,
its argmax must equal our token; positions closer than that are skipped (and counted). Our
raw log-probabilities of the chosen tokens must match transformers' within TOL too.
"""

from __future__ import annotations

import random

import torch

from app.engine import Engine
from app.ipc.messages import SamplingParams

TOL = 1e-3
NEW_TOKENS = 10


def prompts_for(vocab: int, seed: int = 7) -> list[list[int]]:
    """8 prompts of different lengths (3..70 tokens) of random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (3, 9, 17, 24, 33, 41, 58, 70)]


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
    engine.scheduler.memory.allocator.check()  # the device-side checks of every free (CUDA's path)


GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
