"""Model implementations and the registry from a config's architecture name to its class.

Every supported architecture (see ``app.engine.model_config.ARCHITECTURES``) maps to a class with
``forward(input_ids, positions, batch, *, all_logits=False)`` and ``checkpoint_tensors()``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import torch

from app.engine.model_config import ARCHITECTURES, ModelConfig
from app.engine.models.llama import LlamaForCausalLM

CausalLM = LlamaForCausalLM  # the one decoder; a union once another family arrives

MODEL_CLASSES: Mapping[str, type[CausalLM]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,  # same weights and forward; see sliding_window in ModelConfig
        "Qwen2ForCausalLM": LlamaForCausalLM,  # qkv bias through ModelConfig.qkv_bias
        "Qwen3ForCausalLM": LlamaForCausalLM,  # q/k norm through ModelConfig.qk_norm
    }
)


def build_model(config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """The model for ``config`` with uninitialised parameters on ``device`` (fill with weights.py)."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ValueError(
            f"no model class for architecture {config.architecture!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return cls(config, dtype=dtype, device=device)
