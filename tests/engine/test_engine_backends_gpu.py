"""On a GPU: the triton and flashinfer backends serve the same greedy tokens as the torch one.

bf16 weights (flashinfer's prefill has no float32 path) and head sizes flashinfer takes (64,
128). The engine issue's rule, with a bf16 tolerance: tokens must agree wherever the torch
backend's top-2 gap is at least TOL; after the first near tie the sequences may rightly differ,
so the comparison of that request stops there.
"""

from __future__ import annotations

import random

import pytest
import torch
from greedy_rule import compare_greedy

from app.engine import Engine
from app.engine.make_checkpoint import ModelSpec, make_checkpoint
from app.ipc.messages import SamplingParams

TOL = 0.1  # log-probability units: bf16 logits of unit scale differ by a few 1e-2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPECS = {
    "llama-gqa4-d64": ModelSpec(num_layers=2, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2,
                                head_dim=64, vocab_size=1024, max_position_embeddings=1024, rope_theta=10_000.0,
                                dtype="bfloat16", seed=7, init_std=0.06),
    "qwen3-d128": ModelSpec(architecture="Qwen3ForCausalLM", num_layers=2, hidden_size=256, intermediate_size=512,
                            num_heads=4, num_kv_heads=1, head_dim=128, vocab_size=1024, max_position_embeddings=1024,
                            rope_theta=10_000.0, dtype="bfloat16", seed=8, init_std=0.06),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def half_checkpoint(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param) / "model", SPECS[request.param])


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_backends_agree_with_torch_on_bf16(half_checkpoint, backend):
    from app.engine.attention.flashinfer_backend import flashinfer_available

    if backend == "flashinfer" and not flashinfer_available(torch.device("cuda"), torch.bfloat16):
        pytest.skip("flashinfer is not installed here")
    common = dict(device="cuda", dtype="bfloat16", max_total_tokens=8192, chunked_prefill_size=64)
    reference = Engine(str(half_checkpoint), attention_backend="torch", **common)
    ours = Engine(str(half_checkpoint), attention_backend=backend, **common)
    assert ours.built.plan.attention.prefill == backend
    rng = random.Random(3)
    vocab = reference.built.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 17, 40, 90, 150, 220)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    expected = reference.generate(input_ids=prompts, sampling_params=params)
    got = ours.generate(input_ids=prompts, sampling_params=params)
    compared, _ = compare_greedy(expected, got, TOL)
    print(f"{backend}: {compared} positions compared")
    assert compared >= len(prompts)  # the first token of most prompts at least
    usage = ours.scheduler.stats().usage
    assert usage.consistent and usage.used == 0
