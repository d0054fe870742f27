"""The attention backend interface: the one place that touches the KV pool during a forward step.

The model computes q, k, v for the new tokens and hands them to a backend, which stores k/v at
``batch.out_cache_loc`` and attends each sequence's new queries over its whole context,
``req_to_token[req, :seq_len]``, causally within the new part. Backends differ only in kernels
(torch reference, triton, flashinfer), so the model never knows which one runs.

The backends adapt the engine's batch, KV pool and request table to the kernels, one module each:
``torch_backend`` (the reference, any device), ``triton_backend`` (our kernels in app/kernels) and
``flashinfer_backend`` (flashinfer's paged kernels, CUDA). Import the one you need: the triton and
flashinfer ones load their libraries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from app.engine.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Paged attention over a KV pool and a request table that the backend is constructed with."""

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> Any:
        """Prepare what every layer of this step shares (gathered slot ids, masks, kernel plans).

        Called once per step by ``ForwardBatch.build``, after the new slots are in the request table;
        the result is stored as ``batch.attn_metadata``.
        """

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """Store k/v of the new tokens in layer ``layer_id`` of the pool, then attend.

        Shapes: q ``[T, num_heads, head_dim]``, k and v ``[T, num_kv_heads, head_dim]`` (GQA when
        num_heads is a multiple of num_kv_heads); returns ``[T, num_heads, head_dim]`` in q's dtype.
        """

    def decode_tiling(self) -> str:
        """How the decode kernels cut the work (e.g. ``"splits=16,min_len=64,block_n=64"``), for the
        engine's report and the benchmarks' JSON lines; "" where there are no such knobs."""
        return ""


@runtime_checkable
class AttendStoredKV(Protocol):
    """A backend that attends over K/V the model stored itself (triton's and flashinfer's): with
    the fused kernels the model's rotary kernel (or its qkv gemv) writes the new tokens' K/V to
    ``layer_cache`` at ``batch.out_cache_loc``, and the backend skips its own store."""

    def layer_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V caches ``[num_slots, num_kv_heads, head_dim]``."""

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """``forward`` without its store: the step's K/V are already at ``batch.out_cache_loc``."""
