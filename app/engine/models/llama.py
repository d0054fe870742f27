"""The decoder shared by Llama, Mistral, Qwen2 and Qwen3; ``ModelConfig`` flags select the variant.

Qwen2 adds biases to the q/k/v projections; Qwen3 normalises q and k per head before rotary.
q/k/v and gate/up are fused into one matmul each; ``checkpoint_tensors`` tells the loader which
rows of a fused weight each checkpoint tensor fills.

The residual stream is carried beside the hidden states, so that each residual add fuses with
the norm after it (``--fused-kernels``)::

    h, r = embed(ids), None
    per layer:  h, r = input_norm(h + r)      (layer 0: r = h, h = input_norm(h))
                h    = attn(h)
                h, r = post_attn_norm(h + r)
                h    = mlp(h)
    logits = lm_head(final_norm(h + r))

which is ``x = x + attn(norm(x)); x = x + mlp(norm(x))`` with the same additions in the same
dtype, so the torch path computes exactly what it did before the restructuring.

A step of one token (batch-1 decode) with ``DecodeKernels`` (``--fused-decode``) computes the same
in fewer kernels: each norm (with its residual add) runs inside the linear layer after it, SiLU-
and-mul inside down_proj, and on a backend that attends over K/V stored by the model (triton) the
KV store inside the rotary kernel::

    layer 0:    qkv, r = qkv_proj(input_norm(embed[id]))    one kernel: the lookup is its prologue's
    per layer:  qkv, r = qkv_proj(input_norm(h + r))        one kernel: gemv_add_rms_norm
                q, k   = rotary(q, k); cache[loc] = k, v    one kernel: apply_rotary_store_kv
                h      = o_proj(attend(q))                  the attention's kernels, then a gemv
                gu, r  = gate_up_proj(post_attn_norm(h + r))   gemv_add_rms_norm
                h      = down_proj(silu(gate) * up)         gemv_silu_mul
                (--fused-silu-out: a, r = silu_mul(gate_up_proj(post_attn_norm(h + r)))
                 in gemv_add_rms_norm's epilogue, then h = down_proj(a): a plain gemv)
                (--fused-mlp: h, r = mlp(post_attn_norm(h + r)) in one kernel, h a float32 sum:
                 triton_fused_mlp, over down's weight, stored transposed)
    logits = lm_head(final_norm(h + r))                     gemv_add_rms_norm
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol, cast, runtime_checkable

import torch
from torch import nn

from app.engine.forward_batch import ForwardBatch
from app.engine.model_config import ModelConfig
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
    triton_kernels,
)
from app.kernels.pdl_modes import EARLY_TRIGGER_MODES


class WeightTarget(NamedTuple):
    """Where a checkpoint tensor goes: ``param[rows]`` (all of ``param`` for ``slice(None)``)."""

    param: torch.Tensor
    rows: slice

    @property
    def view(self) -> torch.Tensor:
        return self.param.data[self.rows]


@runtime_checkable
class AttendStoredKV(Protocol):
    """An attention backend that attends over K/V the model stored itself (triton's and flashinfer's)."""

    def layer_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V caches ``[num_slots, num_kv_heads, head_dim]``."""

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """``forward`` without its store: the step's K/V are already at ``batch.out_cache_loc``."""


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

    def attend(self, qkv: torch.Tensor, rope: Rope, batch: ForwardBatch, decode: DecodeKernels | None = None,
               keep: torch.Tensor | None = None, *, rotated_and_stored: bool = False) -> torch.Tensor:
        """Attention of the qkv projection's output ``[T, q + 2 kv]``, through o_proj. With
        ``decode`` (the backend is an :class:`AttendStoredKV`, rope has tables), its rotary kernel
        rotates q and k and stores k and v, and the backend only attends; so does the fused
        kernels' one for any step on such a backend (triton's or flashinfer's); ``rotated_and_stored``
        (same backend): the projection did that itself (--fused-qkv-rotary), q is ready. ``keep``:
        the rows (token indices) whose output is wanted: o_proj runs on those alone (K and V of
        every token are stored all the same)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and not rotated_and_stored:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, on the [T, H, D] views
        if rotated_and_stored:
            out = cast(AttendStoredKV, batch.attn_backend).attend(q, self.layer_id, batch)
        elif decode is not None or (self.kernels is not None and isinstance(batch.attn_backend, AttendStoredKV)):
            # The rotary kernel also stores K and V; the backend only attends (one kernel fewer a layer).
            rotary_store_kv = decode.rotary_store_kv if decode is not None else cast(FusedKernels, self.kernels).rotary_store_kv
            backend = cast(AttendStoredKV, batch.attn_backend)
            k_cache, v_cache = backend.layer_cache(self.layer_id)
            rotary_store_kv(q, k, v, rope.cos, rope.sin, rope.positions, k_cache, v_cache, batch.out_cache_loc)
            out = backend.attend(q, self.layer_id, batch)
        else:
            q, k = rotate_qk(q, k, rope, self.kernels)
            out = batch.attn_backend.forward(q, k, v, self.layer_id, batch)
        out = out.reshape(num_tokens, self.q_size)
        return self.o_proj(out if keep is None else out[keep])


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

    def forward_one_token(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Rope, batch: ForwardBatch,
                          kernels: DecodeKernels, store_kv: bool, embed_ids: torch.Tensor | None = None,
                          mlp_sums: tuple[torch.Tensor, torch.Tensor] | None = None) -> NormResidual:
        """:meth:`forward` of one token ``[1, hidden]`` with the decode kernels (the module
        docstring's diagram); ``store_kv``: the rotary kernel stores K/V (see Attention.attend).
        ``embed_ids`` (the first layer): ``hidden`` is the embedding table and the token's row is
        read by the qkv kernel itself (no embedding lookup before it). ``mlp_sums`` (--fused-mlp):
        the float32 buffer the MLP kernel sums into (zero) and the one it zeroes."""
        attn, mlp = self.self_attn, self.mlp
        norm = self.input_layernorm
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
        hidden = attn.attend(qkv, rope, batch, kernels if store_kv and rotary is None else None,
                             rotated_and_stored=rotary is not None)
        norm = self.post_attention_layernorm
        if mlp_sums is not None and kernels.fused_mlp is not None:
            # Launched plainly (as a dependent of o it lost: variant 71); down's PDL mode says
            # whether it lets qkv launch, and when: at its programs' start with an early mode
            # ("preload", "wait"), after their tile loop with a late one ("late", "wait-late").
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
        self.decode_kernels: DecodeKernels | None = None  # see use_decode_kernels

    def use_small_batch_linear(self, kernel: SmallBatchLinear | None,
                               by_role: Mapping[str, SmallBatchLinear] | None = None) -> None:
        """Route every linear layer (and the output projection) of one-row inputs
        through ``kernel`` (``--triton-gemv``: decode steps stream each weight once); None: torch.
        ``by_role``: another kernel for the layers of a role (qkv, o, gate_up, down, lm_head),
        e.g. the same gemv launched differently (``--gemv-pdl-mode`` per role)."""
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
        """Run steps of one token (batch-1 decode) through ``kernels`` (``--fused-decode``); None:
        as any other step. Raises ValueError on a model without fused kernels, whose rotary has
        no cos/sin tables for the rotary kernel to gather."""
        if kernels is not None and not self.fused_kernels:
            raise ValueError("decode kernels need a model built with fused_kernels (--fused-kernels)")
        if kernels is not None and kernels.qkv_rotary_fits is not None:
            # The qkv gemv rotates and stores K/V itself where its programs can hold whole rotary
            # pairs, and not with a q/k norm (which needs a whole head before rotating).
            cfg = self.config
            fits = not cfg.qk_norm and kernels.qkv_rotary_fits(
                cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, self.embed_tokens.weight.device)
            if not fits:
                kernels = kernels._replace(qkv_rotary_store=None, qkv_rotary_fits=None)
        if kernels is not None and kernels.fused_mlp_fits is not None:
            kernels = self._use_fused_mlp(kernels)
        self.decode_kernels = kernels

    def _use_fused_mlp(self, kernels: DecodeKernels) -> DecodeKernels:
        """--fused-mlp where it fits: three float32 sums that the layers take in turn (see
        :meth:`_mlp_sums`); each down weight is stored transposed once the weights are loaded
        (:meth:`prepare_decode_weights`)."""
        cfg, weight = self.config, self.embed_tokens.weight
        # One layer would zero its own sum (see _mlp_sums): the two-kernel path there.
        if len(self.layers) < 2 or not kernels.fused_mlp_fits(cfg.hidden_size, cfg.intermediate_size):
            return kernels._replace(fused_mlp=None, fused_mlp_fits=None)
        sums = torch.zeros((3, 1, cfg.hidden_size), dtype=torch.float32, device=weight.device)
        self.register_buffer("mlp_sums", sums, persistent=False)
        self.down_transposed = False
        return kernels

    def _mlp_sums(self, number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``number``'s float32 sum and the buffer it zeroes: its predecessor's (read by its
        own qkv kernel, which ran before it), the last layer's for the first (read by the lm_head
        of the step before). A layer's buffer is never its predecessor's (with an odd number of
        layers the last one takes a third), so each is zero again before its next use. At least
        two layers (:meth:`_use_fused_mlp`)."""
        count = len(self.layers)

        def index(n: int) -> int:
            return 2 if n == count - 1 and count % 2 else n % 2
        return self.mlp_sums[index(number)], self.mlp_sums[index((number - 1) % count)]

    def prepare_decode_weights(self) -> None:
        """Lay out the weights as the decode kernels read them, once they are loaded: with
        --fused-mlp, each down weight stored transposed (:meth:`_store_down_transposed`). The
        model runner calls this before capturing CUDA graphs: a graph records the weights'
        addresses, and the storage this replaces is freed (graphs captured before it, largest
        batch first, read freed memory: NaN logits, 11-30). Else the first one-token step does."""
        if self.decode_kernels is not None and self.decode_kernels.fused_mlp is not None and not self.down_transposed:
            self._store_down_transposed()

    def _store_down_transposed(self) -> None:
        """Store each down weight transposed, once (see :meth:`prepare_decode_weights`): the
        parameter becomes a ``[K, I]`` view of an ``[I, K]`` tensor, whose rows the fused MLP
        kernel reads; torch's matmul takes the view as it is (no copy), and the one-row gemv is
        not used on it (layers.linear). One layer's copy at a time: no memory beyond one down
        weight, none after."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("--fused-mlp: the down weights are transposed before any CUDA graph capture "
                               "(prepare_decode_weights)")
        with torch.no_grad():
            for layer in self.layers:
                weight = layer.mlp.down_proj.weight
                if not weight.t().is_contiguous():
                    weight.data = weight.t().contiguous().t()
        self.down_transposed = True

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
        is exact). A step of one token goes through the decode kernels when the model has them
        (:meth:`use_decode_kernels`).

        ``argmax_keys`` (``--fused-greedy``; steps of one token through the decode kernels only,
        see :meth:`writes_argmax_keys`): the output projection also folds the argmax of the
        logits into these keys (app/kernels/triton_greedy.py).

        ``logits_out`` (``[B, vocab]`` in the model dtype, contiguous; with ``float_logits=False``):
        the output projection writes the logits there and they are returned, so that a decode
        graph's static buffer takes no copy (at 256 rows, 65 MB a step).
        """
        if logits_out is not None and float_logits:
            raise ValueError("logits_out: the logits stay in the model dtype; pass float_logits=False")
        one_token = self.decode_kernels is not None and input_ids.shape[0] == 1
        if argmax_keys is not None and not one_token:
            raise ValueError("argmax_keys: only a step of one token through the decode kernels folds the argmax")
        rope = self.rotary.prepare(positions, self.dtype)
        if one_token:
            assert self.decode_kernels is not None
            logits = self._forward_one_token(input_ids, rope, batch, self.decode_kernels, argmax_keys, logits_out)
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
        through the decode kernels, whose output projection has no bias and indexes the vocabulary."""
        from app.kernels.triton_greedy import MAX_VOCAB  # on demand: only with the decode kernels

        return self.decode_kernels is not None and self.config.vocab_size <= MAX_VOCAB

    def _forward_one_token(self, input_ids: torch.Tensor, rope: Rope, batch: ForwardBatch, kernels: DecodeKernels,
                           argmax_keys: torch.Tensor | None = None, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[1, vocab]`` (model dtype) of a step of one token with the decode kernels.
        One token is its sequence's last, so all_logits changes nothing and nothing is gathered."""
        store_kv = isinstance(batch.attn_backend, AttendStoredKV)
        fused_mlp = kernels.fused_mlp is not None
        self.prepare_decode_weights()
        # The first layer's qkv kernel reads the token's embedding row itself (embed_ids).
        hidden, residual = self.embed_tokens.weight, None
        for number, layer in enumerate(self.layers):
            hidden, residual = layer.forward_one_token(hidden, residual, rope, batch, kernels, store_kv,
                                                       embed_ids=input_ids if number == 0 else None,
                                                       mlp_sums=self._mlp_sums(number) if fused_mlp else None)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return kernels.add_rms_norm_linear(hidden, residual, self.norm.weight, self.norm.eps, weight, None,
                                           argmax_keys=argmax_keys, pdl=kernels.pdl.lm_head, out=logits_out,
                                           config=kernels.config("lm_head", weight))[0]

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
