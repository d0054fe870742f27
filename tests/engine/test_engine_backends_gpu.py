"""On a GPU: the triton and flashinfer backends serve the same greedy tokens as the torch one.

bf16 weights (flashinfer's prefill has no float32 path). The engine issue's rule, with a bf16
tolerance: tokens must agree wherever the torch backend's top-2 gap is at least TOL; after the
first near tie the sequences may rightly differ, so the comparison stops there.
"""

from __future__ import annotations

import random

import pytest
import torch

from app.engine import Engine
from app.ipc.messages import SamplingParams

TOL = 0.1  # log-probability units: bf16 logits of unit scale differ by a few 1e-2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_backends_agree_with_torch_on_bf16(checkpoint, backend):
    from app.kernels.flashinfer_attention import flashinfer_available

    if backend == "flashinfer" and not flashinfer_available(torch.device("cuda"), torch.bfloat16):
        pytest.skip("flashinfer is not installed here")
    common = dict(device="cuda", dtype="bfloat16", max_total_tokens=8192, chunked_prefill_size=64)
    reference = Engine(str(checkpoint), attention_backend="torch", **common)
    ours = Engine(str(checkpoint), attention_backend=backend, **common)
    assert ours.built.attention_backend == backend
    rng = random.Random(3)
    vocab = reference.built.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 17, 40, 90, 150, 220)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    expected = reference.generate(input_ids=prompts, sampling_params=params)
    got = ours.generate(input_ids=prompts, sampling_params=params)
    compared = 0
    for want, have in zip(expected, got):
        for position, (a, b) in enumerate(zip(want.token_ids, have.token_ids)):
            (_, best), (_, second) = want.top_logprobs[position]
            if best - second < TOL:
                break
            assert a == b, f"position {position}"
            assert abs(want.logprobs[position] - have.logprobs[position]) < TOL
            compared += 1
    assert compared >= len(prompts) * 4
    usage = ours.scheduler.stats().usage
    assert usage.consistent and usage.used == 0
