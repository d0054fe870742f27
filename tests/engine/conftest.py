"""Tiny random Hugging Face checkpoints, written by transformers itself, for model tests.

Each variant exercises one architecture feature: Llama-3 rope scaling + GQA + tied embeddings,
untied Llama with attention biases and multi-query attention, Mistral, Qwen2 (q/k/v bias, tied),
Qwen3 (q/k norm, explicit head_dim != hidden / heads). Weights are redrawn at a scale that keeps
activations O(1), so biases, norm weights and attention patterns all matter to the logits.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import pytest
import torch

SEED = 1234
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)


def _config(variant: str):  # -> transformers.PretrainedConfig
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if variant == "llama-tied-llama3":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return LlamaConfig(**_SMALL, num_key_value_heads=2, vocab_size=384, tie_word_embeddings=True,
                           rope_parameters=rope, architectures=["LlamaForCausalLM"])
    if variant == "llama-untied-bias":
        return LlamaConfig(**_SMALL, num_key_value_heads=1, vocab_size=320, tie_word_embeddings=False,
                           attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                           architectures=["LlamaForCausalLM"])
    if variant == "mistral":
        return MistralConfig(**_SMALL, num_key_value_heads=2, vocab_size=256, sliding_window=256,
                             architectures=["MistralForCausalLM"])
    if variant == "qwen2":
        return Qwen2Config(**_SMALL, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
                           architectures=["Qwen2ForCausalLM"])
    if variant == "qwen3":
        return Qwen3Config(**_SMALL, num_key_value_heads=2, head_dim=32, vocab_size=448,
                           tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    raise KeyError(variant)


VARIANTS = ("llama-tied-llama3", "llama-untied-bias", "mistral", "qwen2", "qwen3")


def write_checkpoint(variant: str, out_dir: Path, *, max_shard_size: str | None = None) -> Path:
    """Save a float32 random ``variant`` checkpoint (deterministic) with ``save_pretrained``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_config(variant), dtype=torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:  # weights and embeddings: unit-scale outputs for unit-scale inputs
                param.copy_(noise / math.sqrt(param.shape[-1]))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make_checkpoint(variant, max_shard_size=None)``: a fresh checkpoint directory each call."""

    def make(variant: str, *, max_shard_size: str | None = None) -> Path:
        return write_checkpoint(variant, tmp_path_factory.mktemp(variant), max_shard_size=max_shard_size)

    return make


@pytest.fixture(scope="session", params=VARIANTS)
def checkpoint(request: pytest.FixtureRequest, make_checkpoint: Callable[..., Path]) -> Path:
    """One checkpoint per variant, shared by the tests of the session."""
    return make_checkpoint(request.param)


@pytest.fixture(scope="session")
def reference_models() -> Callable[[Path], object]:
    """transformers' model for a checkpoint path, loaded once per session."""
    from transformers import AutoModelForCausalLM

    cache: dict[Path, object] = {}

    def get(path: Path) -> object:
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get
