"""The decoder shared by Llama, Mistral, Qwen2 and Qwen3; ``ModelConfig`` flags select the variant.

Qwen2 adds biases to the q/k/v projections; Qwen3 normalises q and k per head before rotary.
q/k/v and gate/up are fused into one matmul each; ``checkpoint_tensors`` tells the loader which
rows of a fused weight each checkpoint tensor fills.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from app.engine.forward_batch import ForwardBatch
from app.engine.model_config import ModelConfig
from app.engine.models.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, apply_rotary


class WeightTarget(NamedTuple):
    """Where a checkpoint tensor goes: ``param[rows]`` (all of ``param`` for ``slice(None)``)."""

    param: torch.Tensor
    rows: slice

    @property
    def view(self) -> torch.Tensor:
        return self.param.data[self.rows]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
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
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = batch.attn_backend.forward(q, k, v, self.layer_id, batch)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Attention(config, layer_id, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = MLP(config, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer over the paged KV cache; parameters are uninitialised until loaded."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype=dtype, device=device) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        # Tied: the output projection is embed_tokens.weight itself, not a copy.
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        *,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run one step over the new tokens ``input_ids`` ``[T]`` at ``positions`` ``[T]``.

        Returns float32 logits ``[B, vocab]`` of each sequence's last new token, or ``[T, vocab]``
        for every new token with ``all_logits`` (prompt logprobs, teacher-forced tests).
        """
        cos, sin = self.rotary(positions, self.dtype)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, batch)
        if not all_logits:
            x = x[batch.last_token_indices]
        x = self.norm(x)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight).float()

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
