"""Reference attention backend in plain torch: correct on any device, fast on none.

DECODE runs as one padded ``scaled_dot_product_attention`` over the batch. EXTEND loops over the
sequences (each has its own query and context length); that loop is acceptable here because this
is the reference, and the triton/flashinfer backends replace it behind the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.engine.attention import AttentionBackend
from app.engine.forward_batch import ForwardBatch, ForwardMode
from app.engine.kv_pool import KVPool, ReqToTokenPool


@dataclass(frozen=True, slots=True)
class ExtendSeq:
    """One sequence of an EXTEND step: its queries ``[q_start, q_end)`` attend over ``kv_indices``."""

    q_start: int
    q_end: int
    kv_indices: torch.Tensor  # int64 [seq_len]: slots of positions 0 .. seq_len-1
    # bool [extend_len, seq_len], True where query may attend; None means plain causal (no prefix).
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class ExtendMetadata:
    seqs: tuple[ExtendSeq, ...]


@dataclass(frozen=True, slots=True)
class DecodeMetadata:
    # int64 [B, max_seq_len]: slots per sequence; past seq_len it repeats the last slot, so padding
    # reads real (finite) K/V that the mask then hides.
    kv_indices: torch.Tensor
    mask: torch.Tensor  # bool [B, 1, 1, max_seq_len]: True for positions < seq_len


class TorchAttentionBackend(AttentionBackend):
    """Attention with ``torch.nn.functional.scaled_dot_product_attention`` over gathered K/V."""

    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool, *, scale: float | None = None) -> None:
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.scale = scale  # None: 1/sqrt(head_dim)

    def init_forward_metadata(self, batch: ForwardBatch) -> ExtendMetadata | DecodeMetadata:
        """Gather every sequence's slot ids once per step (one indexed read of the request table)."""
        device = batch.seq_lens.device
        max_len = max(batch.seq_lens_cpu)
        cols = torch.arange(max_len, device=device)
        cols = torch.minimum(cols[None, :], batch.seq_lens[:, None] - 1)
        table = self.req_to_token_pool.req_to_token
        kv_indices = table[batch.req_pool_indices[:, None], cols].to(torch.int64)  # [B, max_len]
        if batch.mode is ForwardMode.DECODE:
            mask = torch.arange(max_len, device=device)[None, :] < batch.seq_lens[:, None]
            return DecodeMetadata(kv_indices=kv_indices, mask=mask[:, None, None, :])

        seqs = []
        q_start = 0
        for i, (prefix, extend) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True)):
            seq_len = prefix + extend
            mask = None
            if prefix:
                # Query j sits at position prefix + j and sees keys 0 .. prefix + j.
                q_pos = torch.arange(prefix, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            seqs.append(ExtendSeq(q_start, q_start + extend, kv_indices[i, :seq_len], mask))
            q_start += extend
        return ExtendMetadata(tuple(seqs))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_cache, v_cache = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        meta = batch.attn_metadata
        if isinstance(meta, DecodeMetadata):
            # [B, H, 1, D] queries against [B, KVH, S, D] keys.
            keys = k_cache[meta.kv_indices].transpose(1, 2).to(q.dtype)
            values = v_cache[meta.kv_indices].transpose(1, 2).to(q.dtype)
            out = F.scaled_dot_product_attention(
                q[:, :, None, :], keys, values, attn_mask=meta.mask, scale=self.scale, enable_gqa=True
            )
            return out[:, :, 0, :]

        out = torch.empty_like(q)
        for seq in meta.seqs:
            qs = q[seq.q_start : seq.q_end].transpose(0, 1)  # [H, E, D]
            keys = k_cache[seq.kv_indices].transpose(0, 1).to(q.dtype)  # [KVH, S, D]
            values = v_cache[seq.kv_indices].transpose(0, 1).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qs,
                keys,
                values,
                attn_mask=seq.mask,
                is_causal=seq.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[seq.q_start : seq.q_end] = o.transpose(0, 1)
        return out
