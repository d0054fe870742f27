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

from app.engine.config import FusedMlpKnobs, GemvBlockKnobs, GemvPdlRoles, GemvRowRoles, GemvRowsKnobs
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


def build_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    fused_kernels: bool = False,
    triton_gemv: bool = False,
    fused_decode: bool = False,
    gemv_pdl: bool | str = False,
    fused_qkv_rotary: bool = False,
    fused_silu_out: bool = False,
    gemv_rows: GemvRowRoles | None = None,
    fused_mlp: bool = False,
    fused_mlp_knobs: FusedMlpKnobs | None = None,
    gemv_rows_knobs: GemvRowsKnobs | None = None,
    gemv_block_knobs: GemvBlockKnobs | None = None,
) -> CausalLM:
    """The model for ``config`` with uninitialised parameters on ``device`` (fill with weights.py).

    ``fused_kernels``: our triton kernels for the norms, rotary and SiLU-and-mul (``--fused-kernels``);
    ``triton_gemv``: our decode-shaped linear kernel for one-row inputs
    (``--triton-gemv``); ``fused_decode``: the fused kernels of one-token steps (``--fused-decode``,
    needs ``fused_kernels``); ``gemv_pdl``: those gemv kernels launch as programmatic dependents
    (``--gemv-pdl``, CUDA only; True (preload), or a ``--gemv-pdl-mode`` spec: one mode of
    triton_gemv.PDL_MODES or role=mode pairs, see GemvPdlRoles); ``fused_qkv_rotary``: the
    one-token qkv gemv rotates and stores K/V too (``--fused-qkv-rotary``, with ``fused_decode``);
    ``fused_silu_out``: the one-token gate_up gemv stores silu(gate) * up and down is a plain
    gemv (``--fused-silu-out``, with ``fused_decode``); ``gemv_rows``: the roles whose one-row gemv
    runs persistent (``--gemv-rows``, with ``triton_gemv``), launched as ``gemv_rows_knobs`` change
    their tiling (``--gemv-rows-config``), the others as ``gemv_block_knobs`` change theirs
    (``--gemv-config``); ``fused_mlp``: the one-token MLP runs as
    one kernel (``--fused-mlp``, with ``fused_decode``), launched as ``fused_mlp_knobs`` change its
    tuned config (``--fused-mlp-config``). The caller checks that triton can run
    here: CUDA, or TRITON_INTERPRET=1."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ValueError(
            f"no model class for architecture {config.architecture!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    model = cls(config, dtype=dtype, device=device, fused_kernels=fused_kernels)
    pdl = GemvPdlRoles.parse("preload" if gemv_pdl is True else gemv_pdl) if gemv_pdl else GemvPdlRoles()
    rows = gemv_rows or GemvRowRoles()
    if triton_gemv:
        # on demand: CPU-only runs never import triton
        from app.kernels.triton_gemv import default_config, device_sms, gemv, rows_config

        persistent_for = role_rows_config(rows_config, gemv_rows_knobs)
        block_for = role_block_config(default_config, device_sms, gemv_block_knobs)
        changed = set((gemv_block_knobs or GemvBlockKnobs()).changed_roles())
        by_role = {}
        for role, mode, on in zip(pdl._fields, pdl, rows):
            config_for = persistent_for if on else block_for if role in changed else None
            if mode or config_for is not None:
                by_role[role] = _role_gemv(gemv, config_for and functools.partial(config_for, role), mode)
        model.use_small_batch_linear(gemv, by_role)
    if fused_decode:
        model.use_decode_kernels(decode_kernels(pdl=pdl, qkv_rotary=fused_qkv_rotary, silu_out=fused_silu_out,
                                                rows=rows, fused_mlp=fused_mlp, fused_mlp_knobs=fused_mlp_knobs,
                                                rows_knobs=gemv_rows_knobs, block_knobs=gemv_block_knobs))
    return model


def _role_gemv(gemv: Callable[..., torch.Tensor], config_for: Callable[..., Any] | None,
               pdl: str) -> Callable[..., torch.Tensor]:
    """The one-row gemv of a role: launched as its --gemv-pdl-mode says, at ``config_for(n, k,
    device=...)``'s launch for the weight where given: persistent where --gemv-rows names the role
    (rows_config's tiling, where one fits; that kernel launches plainly whatever the mode), else
    the row-block kernel as --gemv-config changes it."""
    if config_for is None:
        return functools.partial(gemv, pdl=pdl)

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        config = config_for(weight.shape[0], weight.shape[1], device=weight.device)
        return gemv(x, weight, bias, pdl=pdl or False, config=config)
    return linear
