"""One model step over a batch of sequences: which tokens are new, where their K/V go, what to attend.

Token layout of an EXTEND batch (new tokens of all sequences packed back to back)::

    seq:            0            1                2
    prefix_lens:    3            0                5      (already in the KV cache)
    extend_lens:    2            4                1      (new this step)
    seq_lens:       5            4                6      (= prefix + extend)
    tokens [T=7]:  [a3 a4      | b0 b1 b2 b3    | c5]
    positions:     [3  4       | 0  1  2  3     | 5 ]
    last_token_indices:  1               5        6

A DECODE batch is the same with every extend_len 1. Chunked prefill is EXTEND with prefix_lens
covering the chunks already done.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from app.engine.kv_pool import ReqToTokenPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill of new tokens on top of a cached prefix (possibly empty)
    DECODE = "decode"  # one new token per sequence


class StepAttention(Protocol):
    """What a batch needs of its attention backend: app.engine.attention.AttentionBackend is one
    (stated here as a protocol so that the batch does not import the backends, which take batches)."""

    def init_forward_metadata(self, batch: ForwardBatch) -> Any:
        """What every layer of the step shares; stored as ``batch.attn_metadata``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """Store the new tokens' k/v in layer ``layer_id`` of the pool, then attend."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardBatch:
    """Everything a forward step needs besides the input ids. Build it with ``ForwardBatch.build``."""

    mode: ForwardMode
    req_pool_indices: torch.Tensor  # int64 [B]: each sequence's row in the request table
    seq_lens: torch.Tensor  # int64 [B]: tokens in cache after this step
    prefix_lens: torch.Tensor  # int64 [B]: tokens in cache before this step
    extend_lens: torch.Tensor  # int64 [B]: new tokens this step (all 1 in DECODE)
    out_cache_loc: torch.Tensor  # int64 [T]: KV slot of each new token
    positions: torch.Tensor  # int64 [T]: position of each new token in its sequence
    last_token_indices: torch.Tensor  # int64 [B]: index into [T] of each sequence's last new token
    # Host copies, so backends can size and slice without a device sync.
    seq_lens_cpu: tuple[int, ...]
    prefix_lens_cpu: tuple[int, ...]
    extend_lens_cpu: tuple[int, ...]
    attn_backend: StepAttention
    attn_metadata: Any  # what attn_backend.init_forward_metadata prepared for this step

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.numel()

    @classmethod
    def build(
        cls,
        *,
        mode: ForwardMode,
        req_pool_indices: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        out_cache_loc: torch.Tensor,
        req_to_token_pool: ReqToTokenPool,
        attn_backend: StepAttention,
    ) -> ForwardBatch:
        """Describe a step and record its new slots in the request table.

        Writes ``out_cache_loc`` into ``req_to_token[req, prefix:seq_len]`` (the prefix entries must
        already be there), then lets the backend prepare its per-step metadata, which reads those rows.
        Raises ValueError on inconsistent lengths.
        """
        batch_size = len(req_pool_indices)
        if batch_size == 0 or len(prefix_lens) != batch_size or len(extend_lens) != batch_size:
            raise ValueError(
                f"ForwardBatch: need one prefix_len and extend_len per request, got {batch_size} requests, "
                f"{len(prefix_lens)} prefix_lens, {len(extend_lens)} extend_lens"
            )
        if min(extend_lens) < 1 or min(prefix_lens) < 0:
            raise ValueError(f"ForwardBatch: extend_lens must be >= 1 and prefix_lens >= 0, got {extend_lens}, {prefix_lens}")
        if mode is ForwardMode.DECODE and max(extend_lens) != 1:
            raise ValueError(f"ForwardBatch: DECODE extends each sequence by 1 token, got {extend_lens}")
        seq_lens_cpu = tuple(p + e for p, e in zip(prefix_lens, extend_lens, strict=True))
        if max(seq_lens_cpu) > req_to_token_pool.max_context_len:
            raise ValueError(
                f"ForwardBatch: sequence length {max(seq_lens_cpu)} exceeds max_context_len "
                f"{req_to_token_pool.max_context_len}"
            )
        num_tokens = sum(extend_lens)
        if out_cache_loc.shape != (num_tokens,):
            raise ValueError(f"ForwardBatch: out_cache_loc must have shape ({num_tokens},), got {tuple(out_cache_loc.shape)}")

        device = req_to_token_pool.device
        # One host-to-device copy for all per-sequence numbers.
        per_seq = torch.tensor(
            [list(req_pool_indices), list(prefix_lens), list(extend_lens)], dtype=torch.int64
        ).to(device, non_blocking=True)
        req_idx, prefix, extend = per_seq[0], per_seq[1], per_seq[2]
        out_cache_loc = out_cache_loc.to(device=device, dtype=torch.int64)
        ends = torch.cumsum(extend, 0)
        # Token t of sequence s sits at position prefix[s] + (t - first token index of s).
        token_seq = torch.repeat_interleave(torch.arange(batch_size, device=device), extend, output_size=num_tokens)
        positions = torch.arange(num_tokens, device=device) - (ends - extend)[token_seq] + prefix[token_seq]
        req_to_token_pool.write(req_idx[token_seq], positions, out_cache_loc)

        batch = cls(
            mode=mode,
            req_pool_indices=req_idx,
            seq_lens=prefix + extend,
            prefix_lens=prefix,
            extend_lens=extend,
            out_cache_loc=out_cache_loc,
            positions=positions,
            last_token_indices=ends - 1,
            seq_lens_cpu=seq_lens_cpu,
            prefix_lens_cpu=tuple(prefix_lens),
            extend_lens_cpu=tuple(extend_lens),
            attn_backend=attn_backend,
            attn_metadata=None,
        )
        return replace(batch, attn_metadata=attn_backend.init_forward_metadata(batch))
