"""Runs one forward step: turns the scheduler's choice into tensors, calls the model, returns logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.engine.attention import AttentionBackend
from app.engine.forward_batch import ForwardBatch, ForwardMode
from app.engine.kv_pool import ReqToTokenPool
from app.engine.models import CausalLM


class ModelRunner:
    """The model, its attention backend and the request table it reads."""

    def __init__(self, model: CausalLM, attn_backend: AttentionBackend, table: ReqToTokenPool, device: torch.device) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.table = table
        self.device = device

    @torch.inference_mode()
    def forward(
        self,
        mode: ForwardMode,
        rows: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        input_ids: Sequence[int],
        out_cache_loc: torch.Tensor,
    ) -> torch.Tensor:
        """Compute the new tokens' KV (stored at ``out_cache_loc``) and return float32 logits
        ``[B, vocab]`` of each sequence's last new token."""
        batch = ForwardBatch.build(
            mode=mode,
            req_pool_indices=rows,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            out_cache_loc=out_cache_loc,
            req_to_token_pool=self.table,
            attn_backend=self.attn_backend,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.model(ids, batch.positions, batch)
