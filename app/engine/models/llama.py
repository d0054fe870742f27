"""The decoder shared by Llama, Mistral, Qwen2 and Qwen3; ``ModelConfig`` flags select the variant.

Qwen2 adds biases to the q/k/v projections; Qwen3 normalises q and k per head before rotary.
q/k/v and gate/up are fused into one matmul each; ``checkpoint_tensors`` tells the loader which
rows of a fused weight each checkpoint tensor fills.

The residual stream is carried beside the hidden states, so that each residual add fuses with
the norm after it (``fused-kernels``)::

    h, r = embed(ids), None
    per layer:  h, r = input_norm(h + r)      (layer 0: r = h, h = input_norm(h))
                h    = attn(h)
                h, r = post_attn_norm(h + r)
                h    = mlp(h)
    logits = lm_head(final_norm(h + r))

which is ``x = x + attn(norm(x)); x = x + mlp(norm(x))`` with the same additions in the same
dtype.

A step of one token (batch-1 decode) with the decode kernels (``fused-decode``) goes to the
fused path (fused_decode.py), which computes the same in fewer kernels; the forward here hands it
over and is otherwise the one path of every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from app.engine.attention import AttendStoredKV
from app.engine.forward_batch import ForwardBatch
from app.engine.model_config import ModelConfig
from app.engine.models.fused_decode import FusedDecode
from app.engine.models.layers import (
    DecodeKernels,
    Embedding,
    FusedKernels,
    Linear,
    SmallBatchLinear,
    linear,
    NormResidual,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    rotate_qk,
    silu_and_mul,
    store_kv_and_attend,
    triton_kernels,
)


class WeightTarget(NamedTuple):
    """Where a checkpoint tensor goes: ``param[rows]`` (all of ``param`` for ``slice(None)``)."""

    param: torch.Tensor
    rows: slice

    @property
    def view(self) -> torch.Tensor:
        return self.param.data[self.rows]


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        kernels: FusedKernels | None,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        hidden = config.hidden_size
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=config.qkv_bias, dtype=dtype, device=device)
        self.o_proj = Linear(self.q_size, hidden, bias=config.o_bias, dtype=dtype, device=device)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device, kernels=kernels)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device, kernels=kernels)

    def forward(self, x: torch.Tensor, rope: Rope, batch: ForwardBatch, keep: torch.Tensor | None = None
                ) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), rope, batch, keep=keep)

    def attend(self, qkv: torch.Tensor, rope: Rope, batch: ForwardBatch, keep: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Attention of the qkv projection's output ``[T, q + 2 kv]``, through o_proj. With the
        fused kernels on a backend that attends over K/V the model stored (:class:`AttendStoredKV`:
        triton's or flashinfer's), the rotary kernel rotates q and k and stores k and v, and the
        backend only attends. ``keep``: the rows (token indices) whose output is wanted: o_proj
        runs on those alone (K and V of every token are stored all the same)."""
        q, k, v = self.heads(qkv)
        if self.kernels is not None and isinstance(batch.attn_backend, AttendStoredKV):
            out = store_kv_and_attend(self.kernels.rotary_store_kv, q, k, v, rope, self.layer_id, batch)
        else:
            q, k = rotate_qk(q, k, rope, self.kernels)
            out = batch.attn_backend.forward(q, k, v, self.layer_id, batch)
        out = out.reshape(qkv.shape[0], self.q_size)
        return self.o_proj(out if keep is None else out[keep])

    def heads(self, qkv: torch.Tensor, norm: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, num_heads, head_dim]``, k and v ``[T, num_kv_heads, head_dim]``: views of the
        qkv projection's output, q and k normalised per head where the model has a q/k norm
        (unless ``norm`` is False: the projection rotated them already)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if norm and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, on the [T, H, D] views
        return q, k, v


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device, kernels: FusedKernels | None
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.kernels))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        kernels: FusedKernels | None,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device, kernels=kernels)
        self.self_attn = Attention(config, layer_id, dtype=dtype, device=device, kernels=kernels)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device, kernels=kernels)
        self.mlp = MLP(config, dtype=dtype, device=device, kernels=kernels)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Rope, batch: ForwardBatch,
                keep: torch.Tensor | None = None) -> NormResidual:
        """This layer's output (before the residual add, which the next norm fuses) and the
        residual stream up to its input; ``residual`` None for the first layer. ``keep``: the
        token rows wanted from this layer: after attention (which needs every token, and stores
        their K and V) the rest of the layer runs on those rows alone."""
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, rope, batch, keep)
        if keep is not None:
            residual = residual[keep]
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return NormResidual(self.mlp(hidden), residual)


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer over the paged KV cache; parameters are uninitialised until loaded.

    ``fused_kernels``: RMSNorm (with the residual add), rotary and SiLU-and-mul run as our triton
    kernels (CUDA, or the CPU under TRITON_INTERPRET=1) instead of torch ops. Neither path syncs
    with the host or allocates by value, so both can be captured in CUDA graphs.
    """

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str, fused_kernels: bool = False
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.fused_kernels = fused_kernels
        kernels = triton_kernels() if fused_kernels else None
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype=dtype, device=device, kernels=kernels)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device, kernels=kernels)
        # Tied: the output projection is embed_tokens.weight itself, not a copy.
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)
        # Positions never reach max_context_len: the builder caps --context-length there.
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device=device,
                                      kernels=kernels, max_positions=config.max_context_len)
        self.small_batch_linear: SmallBatchLinear | None = None  # see use_small_batch_linear
        self.fused_decode: FusedDecode | None = None  # steps of one token, where set: see use_decode_kernels

    def use_small_batch_linear(self, kernel: SmallBatchLinear | None,
                               by_role: Mapping[str, SmallBatchLinear] | None = None) -> None:
        """Route every linear layer (and the output projection) of one-row inputs
        through ``kernel`` (``triton-gemv``: decode steps stream each weight once); None: torch.
        ``by_role``: another kernel for the layers of a role (qkv, o, gate_up, down, lm_head),
        e.g. the same gemv launched differently (``gemv-pdl-mode`` per role)."""
        roles = by_role or {}
        self.small_batch_linear = roles.get("lm_head", kernel)
        for module in self.modules():
            if isinstance(module, Linear):
                module.small_batch = kernel
        for layer in self.layers:
            for role, module in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                                 ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
                module.small_batch = roles.get(role, kernel)

    def use_decode_kernels(self, kernels: DecodeKernels | None) -> None:
        """Hand steps of one token (batch-1 decode) to the fused decode path over ``kernels``
        (``fused-decode``; fused_decode.py); None: they run as any other step. Raises ValueError
        on a model without fused kernels, whose rotary has no cos/sin tables for the rotary kernel
        to gather."""
        if kernels is not None and not self.fused_kernels:
            raise ValueError("decode kernels need a model built with fused_kernels (fused-kernels)")
        self.fused_decode = FusedDecode(self, kernels) if kernels is not None else None

    def prepare_decode_weights(self) -> None:
        """Give the weights the layout the fused decode path reads (FusedDecode.prepare_weights),
        once they are loaded. The model runner calls this before capturing CUDA graphs, which
        record the weights' addresses."""
        if self.fused_decode is not None:
            self.fused_decode.prepare_weights(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        *,
        all_logits: bool = False,
        float_logits: bool = True,
        argmax_keys: torch.Tensor | None = None,
        logits_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step over the new tokens ``input_ids`` ``[T]`` at ``positions`` ``[T]``.

        Returns float32 logits ``[B, vocab]`` of each sequence's last new token, or ``[T, vocab]``
        for every new token with ``all_logits`` (prompt logprobs, teacher-forced tests). With
        ``float_logits=False`` they stay in the model dtype (decode graphs: at 256 rows and a 128k
        vocabulary the float32 copy is two more passes over 130 MB per step, and converting later
        is exact). A step of one token goes to the fused decode path when the model has one
        (:meth:`use_decode_kernels`).

        ``argmax_keys`` (``fused-greedy``; steps of one token through the fused decode path
        only, see :meth:`writes_argmax_keys`): the output projection also folds the argmax of the
        logits into these keys (app/kernels/triton_greedy.py).

        ``logits_out`` (``[B, vocab]`` in the model dtype, contiguous; with ``float_logits=False``):
        the output projection writes the logits there and they are returned, so that a decode
        graph's static buffer takes no copy (at 256 rows, 65 MB a step).
        """
        if logits_out is not None and float_logits:
            raise ValueError("logits_out: the logits stay in the model dtype; pass float_logits=False")
        fused_decode = self.fused_decode if input_ids.shape[0] == 1 else None
        if argmax_keys is not None and fused_decode is None:
            raise ValueError("argmax_keys: only a step of one token through the fused decode path folds the argmax")
        rope = self.rotary.prepare(positions, self.dtype)
        if fused_decode is not None:
            logits = fused_decode.run(self, input_ids, rope, batch, argmax_keys, logits_out)
            return logits.float() if float_logits else logits
        hidden, residual = self.embed_tokens(input_ids), None
        # Only each sequence's last token reaches the logits: the last layer runs o_proj and the
        # MLP on those rows alone (a prefill of 8k tokens for 16 sequences skips 1/L of its
        # matrix work). Decode steps (one token a sequence) have nothing to drop.
        last = None if all_logits or input_ids.shape[0] == batch.last_token_indices.shape[0] else batch.last_token_indices
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, rope, batch, last if index == len(self.layers) - 1 else None)
        x = self.norm.add_and_norm(hidden, residual).normed
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(x, weight, None, self.small_batch_linear, out=logits_out)
        return logits.float() if float_logits else logits

    def writes_argmax_keys(self) -> bool:
        """Whether a step of one token can fold its argmax into keys (``argmax_keys=``): it runs
        through the fused decode path, whose output projection can (FusedDecode.writes_argmax_keys)."""
        return self.fused_decode is not None and self.fused_decode.writes_argmax_keys(self.config.vocab_size)

    def checkpoint_tensors(self) -> dict[str, WeightTarget]:
        """Every tensor a Hugging Face checkpoint of this model must hold, and where it goes."""
        cfg = self.config
        whole = slice(None)
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        targets = {
            "model.embed_tokens.weight": WeightTarget(self.embed_tokens.weight, whole),
            "model.norm.weight": WeightTarget(self.norm.weight, whole),
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = WeightTarget(self.lm_head.weight, whole)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv_rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
            for name, rows in qkv_rows.items():
                targets[f"{prefix}self_attn.{name}.weight"] = WeightTarget(attn.qkv_proj.weight, rows)
                if attn.qkv_proj.bias is not None:
                    targets[f"{prefix}self_attn.{name}.bias"] = WeightTarget(attn.qkv_proj.bias, rows)
            targets[f"{prefix}self_attn.o_proj.weight"] = WeightTarget(attn.o_proj.weight, whole)
            if attn.o_proj.bias is not None:
                targets[f"{prefix}self_attn.o_proj.bias"] = WeightTarget(attn.o_proj.bias, whole)
            if attn.q_norm is not None and attn.k_norm is not None:
                targets[f"{prefix}self_attn.q_norm.weight"] = WeightTarget(attn.q_norm.weight, whole)
                targets[f"{prefix}self_attn.k_norm.weight"] = WeightTarget(attn.k_norm.weight, whole)
            targets[f"{prefix}mlp.gate_proj.weight"] = WeightTarget(mlp.gate_up_proj.weight, slice(0, inter))
            targets[f"{prefix}mlp.up_proj.weight"] = WeightTarget(mlp.gate_up_proj.weight, slice(inter, 2 * inter))
            targets[f"{prefix}mlp.down_proj.weight"] = WeightTarget(mlp.down_proj.weight, whole)
            targets[f"{prefix}input_layernorm.weight"] = WeightTarget(layer.input_layernorm.weight, whole)
            targets[f"{prefix}post_attention_layernorm.weight"] = WeightTarget(
                layer.post_attention_layernorm.weight, whole
            )
        return targets
