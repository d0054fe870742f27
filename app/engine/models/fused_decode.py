"""The fused batch-1 decode path: a step of one token through the decode kernels (``fused-decode``).

The model's forward hands every step of one token here when it has this path
(``LlamaForCausalLM.use_decode_kernels``); every other step runs its ordinary forward. The path
reads the model's own weights and computes the same function as that forward, in fewer kernels:
each norm (with its residual add) runs inside the linear layer after it, SiLU-and-mul inside
down_proj, and on a backend that attends over K/V stored by the model (triton's, flashinfer's)
the KV store inside the rotary kernel::

    layer 0:    qkv, r = qkv_proj(input_norm(embed[id]))    one kernel: the lookup is its prologue's
    per layer:  qkv, r = qkv_proj(input_norm(h + r))        one kernel: gemv_add_rms_norm
                q, k   = rotary(q, k); cache[loc] = k, v    one kernel: apply_rotary_store_kv
                h      = o_proj(attend(q))                  the attention's kernels, then a gemv
                gu, r  = gate_up_proj(post_attn_norm(h + r))   gemv_add_rms_norm
                h      = down_proj(silu(gate) * up)         gemv_silu_mul
                (fused-silu-out: a, r = silu_mul(gate_up_proj(post_attn_norm(h + r)))
                 in gemv_add_rms_norm's epilogue, then h = down_proj(a): a plain gemv)
                (fused-mlp: h, r = mlp(post_attn_norm(h + r)) in one kernel, h a float32 sum:
                 triton_fused_mlp, over down's weight, stored transposed)
    logits = lm_head(final_norm(h + r))                     gemv_add_rms_norm

(fused-qkv-rotary: the qkv gemv also rotates q and k and stores K/V, where its programs can
hold whole rotary pairs; the rotary kernel then does not run.)

The path keeps only its own state (the kernels that fit the model, the fused MLP's float32 sums,
whether down's weights are stored transposed); the model is passed to each call.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from app.engine.attention import AttendStoredKV
from app.engine.forward_batch import ForwardBatch
from app.engine.model_config import ModelConfig
from app.engine.models.layers import DecodeKernels, Embedding, Linear, NormResidual, RMSNorm, Rope, store_kv_and_attend
from app.kernels.pdl_modes import EARLY_TRIGGER_MODES


class Decoder(Protocol):
    """What the path reads of the model it serves (LlamaForCausalLM): its config and modules.
    Each of ``layers`` has ``self_attn`` (qkv_proj, o_proj, q/k norms), ``mlp`` (gate_up_proj,
    down_proj) and its two norms."""

    config: ModelConfig
    layers: nn.ModuleList
    embed_tokens: Embedding
    norm: RMSNorm
    lm_head: Linear | None


class FusedDecode(nn.Module):
    """Steps of one token of a model through ``kernels``, those of them that fit the model.

    A module only for its buffer (the fused MLP's sums count with the model's bytes and move with
    it); it holds no reference to the model, whose layers each call takes."""

    def __init__(self, model: Decoder, kernels: DecodeKernels) -> None:
        super().__init__()
        cfg = model.config
        device = model.embed_tokens.weight.device
        if kernels.qkv_rotary_fits is not None:
            # The qkv gemv rotates and stores K/V itself where its programs can hold whole rotary
            # pairs, and not with a q/k norm (which needs a whole head before rotating).
            fits = not cfg.qk_norm and kernels.qkv_rotary_fits(
                cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, device)
            if not fits:
                kernels = kernels._replace(qkv_rotary_store=None, qkv_rotary_fits=None)
        sums = None
        if kernels.fused_mlp_fits is not None:
            # fused-mlp where it fits: three float32 sums that the layers take in turn (see
            # _mlp_sums). One layer would zero its own sum: the two-kernel path there.
            if len(model.layers) < 2 or not kernels.fused_mlp_fits(cfg.hidden_size, cfg.intermediate_size):
                kernels = kernels._replace(fused_mlp=None, fused_mlp_fits=None)
            else:
                sums = torch.zeros((3, 1, cfg.hidden_size), dtype=torch.float32, device=device)
        self.kernels = kernels
        self.register_buffer("mlp_sums", sums, persistent=False)
        self.down_transposed = False  # with fused-mlp: each down weight is stored transposed (prepare_weights)

    def writes_argmax_keys(self, vocab_size: int) -> bool:
        """Whether a step can fold its argmax into keys (``argmax_keys=``): the output projection
        has no bias, and the keys index a vocabulary of ``vocab_size``."""
        from app.kernels.triton_greedy import MAX_VOCAB  # on demand: triton runs here

        return vocab_size <= MAX_VOCAB

    def prepare_weights(self, model: Decoder) -> None:
        """Lay out ``model``'s weights as the kernels read them, once they are loaded: with
        fused-mlp, each down weight stored transposed (:meth:`_store_down_transposed`). Call
        before capturing CUDA graphs: a graph records the weights' addresses, and the storage this
        replaces is freed (a graph captured before would read freed memory). Else the first step
        does."""
        if self.kernels.fused_mlp is not None and not self.down_transposed:
            self._store_down_transposed(model)

    def _store_down_transposed(self, model: Decoder) -> None:
        """Store each down weight transposed, once (see :meth:`prepare_weights`): the parameter
        becomes a ``[K, I]`` view of an ``[I, K]`` tensor, whose rows the fused MLP kernel reads;
        torch's matmul takes the view as it is (no copy), and the one-row gemv is not used on it
        (layers.linear). One layer's copy at a time: no memory beyond one down weight, none after."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused-mlp: the down weights are transposed before any CUDA graph capture "
                               "(prepare_decode_weights)")
        with torch.no_grad():
            for layer in model.layers:
                weight = layer.mlp.down_proj.weight
                if not weight.t().is_contiguous():
                    weight.data = weight.t().contiguous().t()
        self.down_transposed = True

    def run(self, model: Decoder, input_ids: torch.Tensor, rope: Rope, batch: ForwardBatch,
            argmax_keys: torch.Tensor | None = None, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[1, vocab]`` (model dtype) of a step of one token (``input_ids`` ``[1]``). One
        token is its sequence's last, so nothing is gathered. ``argmax_keys`` and ``logits_out``:
        as the model's forward takes them."""
        kernels = self.kernels
        store_kv = isinstance(batch.attn_backend, AttendStoredKV)
        fused_mlp = kernels.fused_mlp is not None
        self.prepare_weights(model)
        # The first layer's qkv kernel reads the token's embedding row itself (embed_ids).
        hidden, residual = model.embed_tokens.weight, None
        count = len(model.layers)
        for number, layer in enumerate(model.layers):
            hidden, residual = self._layer(layer, hidden, residual, rope, batch, store_kv,
                                           embed_ids=input_ids if number == 0 else None,
                                           mlp_sums=self._mlp_sums(number, count) if fused_mlp else None)
        weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        return kernels.add_rms_norm_linear(hidden, residual, model.norm.weight, model.norm.eps, weight, None,
                                           argmax_keys=argmax_keys, pdl=kernels.pdl.lm_head, out=logits_out,
                                           config=kernels.config("lm_head", weight))[0]

    def _layer(self, layer: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
               batch: ForwardBatch, store_kv: bool, embed_ids: torch.Tensor | None = None,
               mlp_sums: tuple[torch.Tensor, torch.Tensor] | None = None) -> NormResidual:
        """A decoder layer over one token ``[1, hidden]`` (the module docstring's diagram), as its
        forward returns it: the output before the residual add, and the residual stream;
        ``store_kv``: the backend attends over K/V the model stored. ``embed_ids`` (the first
        layer): ``hidden`` is the embedding table and the token's row is read by the qkv kernel
        itself (no embedding lookup before it). ``mlp_sums`` (fused-mlp): the float32 buffer the
        MLP kernel sums into (zero) and the one it zeroes."""
        kernels = self.kernels
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        rotary = None
        if store_kv and kernels.qkv_rotary_store is not None:  # the qkv gemv rotates and stores K/V too
            k_cache, v_cache = cast(AttendStoredKV, batch.attn_backend).layer_cache(attn.layer_id)
            rotary = kernels.qkv_rotary_store(rope.cos, rope.sin, rope.positions, batch.out_cache_loc, k_cache, v_cache,
                                              attn.num_heads)
        pdl = kernels.pdl
        qkv, residual = kernels.add_rms_norm_linear(hidden, residual, norm.weight, norm.eps, attn.qkv_proj.weight,
                                                    attn.qkv_proj.bias, rotary=rotary, pdl=pdl.qkv, embed_ids=embed_ids,
                                                    config=kernels.config("qkv", attn.qkv_proj.weight, even=rotary is not None,
                                                                          head_dim=attn.head_dim if rotary else None))
        hidden = self._attention(attn, qkv, rope, batch, store_kv, rotated_and_stored=rotary is not None)
        norm = layer.post_attention_layernorm
        if mlp_sums is not None and kernels.fused_mlp is not None:
            # Launched plainly (as a dependent of o it lost); down's PDL mode says whether it lets
            # qkv launch, and when: at its programs' start with an early mode ("preload", "wait"),
            # after their tile loop with a late one ("late", "wait-late").
            out, residual = kernels.fused_mlp(hidden, residual, norm.weight, norm.eps, mlp.gate_up_proj.weight,
                                              mlp.down_proj.weight.t(), mlp_sums[0], zero=mlp_sums[1],
                                              trigger=bool(pdl.down), trigger_at_start=pdl.down in EARLY_TRIGGER_MODES)
            return NormResidual(out, residual)
        if kernels.linear is not None:  # the gate_up gemv stores silu(gate) * up; down is a plain gemv
            act, residual = kernels.add_rms_norm_linear(hidden, residual, norm.weight, norm.eps, mlp.gate_up_proj.weight,
                                                        mlp.gate_up_proj.bias, silu_mul=True, pdl=pdl.gate_up,
                                                        config=kernels.config("gate_up", mlp.gate_up_proj.weight, even=True))
            return NormResidual(kernels.linear(act, mlp.down_proj.weight, mlp.down_proj.bias, pdl=pdl.down,
                                               config=kernels.config("down", mlp.down_proj.weight)), residual)
        gate_up, residual = kernels.add_rms_norm_linear(hidden, residual, norm.weight, norm.eps,
                                                        mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, pdl=pdl.gate_up,
                                                        config=kernels.config("gate_up", mlp.gate_up_proj.weight))
        return NormResidual(kernels.silu_mul_linear(gate_up, mlp.down_proj.weight, mlp.down_proj.bias, pdl=pdl.down,
                                                    config=kernels.config("down", mlp.down_proj.weight)), residual)

    def _attention(self, attn: nn.Module, qkv: torch.Tensor, rope: Rope, batch: ForwardBatch, store_kv: bool, *,
                   rotated_and_stored: bool) -> torch.Tensor:
        """The layer's attention of the qkv projection's output ``[1, q + 2 kv]``, through o_proj.
        ``rotated_and_stored``: the projection rotated q and k and stored K/V itself
        (fused-qkv-rotary), the backend only attends; else with ``store_kv`` the decode kernels'
        rotary kernel rotates and stores, and the backend only attends; else (a backend that
        stores K/V itself) the layer's ordinary attention."""
        if not rotated_and_stored and not store_kv:
            return attn.attend(qkv, rope, batch)
        q, k, v = attn.heads(qkv, norm=not rotated_and_stored)
        if rotated_and_stored:
            out = cast(AttendStoredKV, batch.attn_backend).attend(q, attn.layer_id, batch)
        else:
            out = store_kv_and_attend(self.kernels.rotary_store_kv, q, k, v, rope, attn.layer_id, batch)
        return attn.o_proj(out.reshape(qkv.shape[0], attn.q_size))

    def _mlp_sums(self, number: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``number``'s float32 sum (of ``count`` layers) and the buffer it zeroes: its
        predecessor's (read by its own qkv kernel, which ran before it), the last layer's for the
        first (read by the lm_head of the step before). A layer's buffer is never its
        predecessor's (with an odd number of layers the last one takes a third), so each is zero
        again before its next use. At least two layers (see __init__)."""
        def index(n: int) -> int:
            return 2 if n == count - 1 and count % 2 else n % 2
        return self.mlp_sums[index(number)], self.mlp_sums[index((number - 1) % count)]
