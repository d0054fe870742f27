"""Model implementations and the registry from a config's architecture name to its class.

Every supported architecture (see ``app.engine.model_config.ARCHITECTURES``) maps to a class with
``__init__(config, *, dtype, device, fused_kernels=False)``, ``use_small_batch_linear(kernel)``,
``use_decode_kernels(kernels)``, ``forward(input_ids, positions, batch, *, all_logits=False)`` and
``checkpoint_tensors()``.
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from app.engine.kernel_plan import KernelPlan
from app.engine.kernel_specs import GemvPdlRoles
from app.engine.model_config import ARCHITECTURES, ModelConfig
from app.engine.models.layers import decode_kernels, role_block_config, role_rows_config
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


def build_model(config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                plan: KernelPlan = KernelPlan()) -> CausalLM:
    """The model for ``config`` with uninitialised parameters on ``device`` (fill with weights.py),
    running ``plan``'s kernels (default: torch's alone): our triton norm, rotary and SiLU kernels
    (fused_kernels); the triton gemv for one-row inputs (triton_gemv), each role launched in its
    PDL mode (gemv_pdl_mode), persistent where gemv_rows names it (as gemv_rows_knobs change its
    tiling), else as gemv_block_knobs change the row-block tiling; the one-token step's fused
    kernels (fused_decode, with fused_qkv_rotary, fused_silu_out, fused_mlp as fused_mlp_knobs
    launch it). The caller checks that triton can run here: CUDA, or TRITON_INTERPRET=1."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ValueError(
            f"no model class for architecture {config.architecture!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    model = cls(config, dtype=dtype, device=device, fused_kernels=plan.fused_kernels)
    pdl = GemvPdlRoles.parse(plan.gemv_pdl_mode) if plan.gemv_pdl_mode else GemvPdlRoles()
    rows = plan.gemv_rows
    if plan.triton_gemv:
        # on demand: CPU-only runs never import triton
        from app.kernels.triton_gemv import default_config, device_sms, gemv, rows_config

        persistent_for = role_rows_config(rows_config, plan.gemv_rows_knobs)
        block_for = role_block_config(default_config, device_sms, plan.gemv_block_knobs)
        changed = set(plan.gemv_block_knobs.changed_roles())
        by_role = {}
        for role, mode, on in zip(pdl._fields, pdl, rows):
            config_for = persistent_for if on else block_for if role in changed else None
            if mode or config_for is not None:
                by_role[role] = _role_gemv(gemv, config_for and functools.partial(config_for, role), mode)
        model.use_small_batch_linear(gemv, by_role)
    if plan.fused_decode:
        model.use_decode_kernels(decode_kernels(plan))
    return model


def _role_gemv(gemv: Callable[..., torch.Tensor], config_for: Callable[..., Any] | None,
               pdl: str) -> Callable[..., torch.Tensor]:
    """The one-row gemv of a role: launched in its PDL mode (gemv-pdl-mode), at ``config_for(n, k,
    device=...)``'s launch for the weight where given: persistent where gemv-rows names the role
    (rows_config's tiling, where one fits; that kernel launches plainly whatever the mode), else
    the row-block kernel as gemv-config changes it."""
    if config_for is None:
        return functools.partial(gemv, pdl=pdl)

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        config = config_for(weight.shape[0], weight.shape[1], device=weight.device)
        return gemv(x, weight, bias, pdl=pdl or False, config=config)
    return linear
