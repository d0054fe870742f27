"""Attention through flashinfer's paged kernels (CUDA, bf16/fp16).

Our pool is flashinfer's "NHD" paged layout with one token per page: the K buffer of a layer,
``[num_slots, kv_heads, head_dim]``, viewed as ``[num_slots, 1, kv_heads, head_dim]`` is a paged
cache whose page ids are our slot ids. So a step's page table is simply each sequence's slots
(``req_to_token[req, :seq_len]``) flattened, with ``indptr`` their offsets and every last page
full. ``plan()`` runs once per step (it copies the small host-side index arrays to the device
and picks a schedule); each layer then only calls ``run()``.

EXTEND uses the prefill wrapper with a causal mask; flashinfer aligns a sequence's queries to
the end of its KV, which is exactly "the new tokens attend the cached prefix and each other
causally". flashinfer's prefill has no float32 path, so this backend serves half precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from app.engine.attention import AttentionBackend
from app.engine.forward_batch import ForwardBatch, ForwardMode
from app.engine.kv_pool import KVPool, ReqToTokenPool

WORKSPACE_BYTES = 256 * 1024 * 1024


SUPPORTED_HEAD_DIMS = (64, 128, 256)  # flashinfer's prefill kernels refuse smaller heads


def flashinfer_available(device: torch.device, dtype: torch.dtype, head_dim: int = 128) -> bool:
    """Whether this backend can serve here: CUDA, half precision, a head size its kernels
    take, and flashinfer importable."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim not in SUPPORTED_HEAD_DIMS:
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install (JIT, CUDA mismatch) means "not available"
        return False
    return True


@dataclass(frozen=True, slots=True)
class _Planned:
    wrapper: Any  # the prefill or decode wrapper, planned for this step


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention with flashinfer; one plan per step, one run per layer."""

    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool, *, num_heads: int, scale: float | None = None) -> None:
        import flashinfer

        if kv_pool.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flashinfer backend needs bf16 or fp16 KV, got {kv_pool.dtype}; use --attention-backend triton")
        if kv_pool.k[0].shape[2] not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"the flashinfer backend needs head_dim in {SUPPORTED_HEAD_DIMS}, got {kv_pool.k[0].shape[2]}")
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.num_heads = num_heads
        self.num_kv_heads = kv_pool.k[0].shape[1]
        self.head_dim = kv_pool.k[0].shape[2]
        self.scale = scale
        device = kv_pool.device
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        group = num_heads // self.num_kv_heads
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=group >= 4)
        # Per layer, the pool's buffers seen as flashinfer pages of one token each.
        self._paged = [
            (k.view(k.shape[0], 1, k.shape[1], k.shape[2]), v.view(v.shape[0], 1, v.shape[1], v.shape[2]))
            for k, v in zip(kv_pool.k, kv_pool.v)
        ]

    def _page_table(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """indptr (host), indices (device), last_page_len (device) of the step's sequences."""
        seq_lens = batch.seq_lens_cpu
        total = sum(seq_lens)
        indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
        device = batch.seq_lens.device
        rows = torch.repeat_interleave(batch.req_pool_indices, batch.seq_lens, output_size=total)
        starts = torch.repeat_interleave(batch.seq_lens.cumsum(0) - batch.seq_lens, batch.seq_lens, output_size=total)
        positions = torch.arange(total, device=device) - starts
        indices = self.req_to_token_pool.req_to_token[rows, positions].to(torch.int32)
        last_page_len = torch.ones(len(seq_lens), dtype=torch.int32, device=device)
        return indptr, indices, last_page_len

    def init_forward_metadata(self, batch: ForwardBatch) -> _Planned:
        indptr, indices, last_page_len = self._page_table(batch)
        dtype = self.kv_pool.dtype
        common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)
        if batch.mode is ForwardMode.DECODE:
            self._decode.plan(
                indptr, indices, last_page_len, self.num_heads, self.num_kv_heads, self.head_dim, 1, **common
            )
            return _Planned(self._decode)
        qo_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(torch.tensor(batch.extend_lens_cpu, dtype=torch.int32), 0)
        self._prefill.plan(
            qo_indptr, indptr, indices, last_page_len, self.num_heads, self.num_kv_heads, self.head_dim, 1,
            causal=True, **common,
        )
        return _Planned(self._prefill)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        planned: _Planned = batch.attn_metadata
        return planned.wrapper.run(q.contiguous(), self._paged[layer_id])
