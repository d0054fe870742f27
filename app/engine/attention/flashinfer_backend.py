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

DECODE steps can replay CUDA graphs (app.engine.cuda_graph.DecodeGraphBackend). flashinfer's
decode wrapper in ``use_cuda_graph`` mode keeps its page table in caller-owned buffers and fixes
its batch size at construction, so there is one wrapper per captured size ``bs``, all over views
of the same static buffers, sized once for the largest::

    indptr         int32 [max_bs + 1]   wrapper bs uses [:bs + 1]
    last_page_len  int32 [max_bs]       wrapper bs uses [:bs]; always 1 (pages of one token)
    indices        int32 [max_bs * max_context_len]   shared; a step uses [:indptr[bs]]

A step of ``b`` sequences replayed as ``bs``: the real rows' slots are gathered on the device
straight into ``indices`` (no host sync: the host knows every length), and each padded row gets
one page, the dummy slot 0 (which the padded token itself writes in the same step), so no row is
empty and nothing live is read. Then ``plan()`` runs, outside the graph: its host work picks the
schedule and it copies the host indptr and last_page_len into the wrapper's buffers and its plan
into the wrapper's own int workspace, all at addresses fixed when the graph was captured. A
prefix shared through the radix cache is gathered once per row that uses it, so the sum of
lengths can exceed the pool's slot count; ``max_bs * max_context_len`` is the bound that holds
(e.g. 256 * 32768 * 4 bytes = 32 MiB). Each wrapper also holds flashinfer's own int workspace
for its plan, 8 MiB on the device and 8 MiB pinned on the host (35 sizes up to 256: 280 MiB each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from app.engine.attention import AttentionBackend
from app.engine.cuda_graph import DUMMY_SLOT
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


def padded_decode_indptr(seq_lens: Sequence[int], bs: int) -> list[int]:
    """The host indptr (``bs + 1`` offsets) of a decode graph step: the ``b = len(seq_lens)``
    real sequences' lengths, then ``bs - b`` padded rows of one page each."""
    b = len(seq_lens)
    if b > bs or min(seq_lens, default=1) < 1:
        raise ValueError(f"padded_decode_indptr: need at most {bs} lengths, each >= 1, got {list(seq_lens)}")
    indptr = [0]
    for n in seq_lens:
        indptr.append(indptr[-1] + n)
    for _ in range(bs - b):
        indptr.append(indptr[-1] + 1)
    return indptr


def gather_page_indices(
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    total: int,
    num_padded: int = 0,
) -> None:
    """Write the slots of each sequence, ``req_to_token[req_pool_indices[i], :seq_lens[i]]``,
    back to back into ``out[:total]`` (``total`` = the lengths' sum, known on the host, so there
    is no device sync), then the dummy slot for ``num_padded`` padded rows of one page each."""
    if total:
        device = out.device
        rows = torch.repeat_interleave(req_pool_indices, seq_lens, output_size=total)
        starts = torch.repeat_interleave(seq_lens.cumsum(0) - seq_lens, seq_lens, output_size=total)
        positions = torch.arange(total, device=device) - starts
        out[:total] = req_to_token[rows, positions]
    if num_padded:
        out[total : total + num_padded].fill_(DUMMY_SLOT)


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
        # Tensor cores (the prefill kernels) pay off once a KV head serves 4 or more query heads.
        self._decode_tensor_cores = num_heads // self.num_kv_heads >= 4
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self._decode_tensor_cores
        )
        # Per layer, the pool's buffers seen as flashinfer pages of one token each.
        self._paged = [
            (k.view(k.shape[0], 1, k.shape[1], k.shape[2]), v.view(v.shape[0], 1, v.shape[1], v.shape[2]))
            for k, v in zip(kv_pool.k, kv_pool.v)
        ]
        # Per wrapper (by id), an event after the copies of its last plan (see _plan).
        self._plan_copied: dict[int, Any] = {}
        # Decode CUDA graphs (init_cuda_graph_state sizes these): one wrapper per captured size.
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_indptr = torch.zeros(0, dtype=torch.int32)
        self._graph_indices = torch.zeros(0, dtype=torch.int32)
        self._graph_last_page_len = torch.ones(0, dtype=torch.int32)
        self._graph_ones = torch.ones(0, dtype=torch.int32)

    def _plan_kwargs(self) -> dict[str, Any]:
        dtype = self.kv_pool.dtype
        return dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)

    def _plan(self, wrapper: Any, *args: Any, **kwargs: Any) -> None:
        """``wrapper.plan(...)``, but never while that wrapper's previous plan is still being
        copied: plan() writes the schedule into the wrapper's pinned host buffer and queues its
        copy to the device, so rewriting the buffer before that copy ran (a step planned while
        the device is still behind, as an overlapped scheduler does) would give the earlier step
        this step's schedule. The wait is for a few copies, normally long done."""
        copied = self._plan_copied.get(id(wrapper))
        if copied is not None:
            copied.synchronize()
        wrapper.plan(*args, **kwargs)
        if self.kv_pool.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._plan_copied[id(wrapper)] = event

    def _page_table(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """indptr (host), indices (device), last_page_len (host) of the step's sequences. plan()
        reads indptr and last_page_len on the host, so both stay there (no device round trip)."""
        seq_lens = batch.seq_lens_cpu
        total = sum(seq_lens)
        indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
        indices = torch.empty(total, dtype=torch.int32, device=batch.seq_lens.device)
        gather_page_indices(indices, self.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens, total)
        last_page_len = torch.ones(len(seq_lens), dtype=torch.int32)
        return indptr, indices, last_page_len

    def init_forward_metadata(self, batch: ForwardBatch) -> _Planned:
        indptr, indices, last_page_len = self._page_table(batch)
        if batch.mode is ForwardMode.DECODE:
            self._plan(
                self._decode, indptr, indices, last_page_len, self.num_heads, self.num_kv_heads, self.head_dim, 1,
                **self._plan_kwargs(),
            )
            return _Planned(self._decode)
        qo_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(torch.tensor(batch.extend_lens_cpu, dtype=torch.int32), 0)
        self._plan(
            self._prefill, qo_indptr, indptr, indices, last_page_len, self.num_heads, self.num_kv_heads, self.head_dim,
            1, causal=True, **self._plan_kwargs(),
        )
        return _Planned(self._prefill)

    # ------------------------------------------------------------------ CUDA graphs (decode)
    # app.engine.cuda_graph.DecodeGraphBackend. The graph of size bs runs wrapper bs, whose
    # kernels read _graph_indptr[:bs + 1], _graph_indices, _graph_last_page_len[:bs] and the
    # wrapper's int workspace; _plan_graph refills all of them before every replay.

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate the static page table of graphs up to ``max_bs`` sequences (see the module
        docstring for why the indices are sized ``max_bs * max_context_len``)."""
        device = self.kv_pool.device
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=device)
        self._graph_indices = torch.full(
            (max_bs * self.req_to_token_pool.max_context_len,), DUMMY_SLOT, dtype=torch.int32, device=device
        )
        self._graph_ones = torch.ones(max_bs, dtype=torch.int32)  # host: plan() reads last_page_len there
        self._graph_wrappers = {}

    def init_forward_metadata_capture(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> _Planned:
        """A wrapper fixed to ``bs`` sequences over the static buffers, planned with every row
        padding (a captured graph's schedule depends on ``bs`` only, not on the lengths)."""
        import flashinfer

        if bs + 1 > self._graph_indptr.numel():
            raise ValueError(f"init_forward_metadata_capture: size {bs} exceeds init_cuda_graph_state's max_bs")
        self._graph_wrappers[bs] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self._decode_tensor_cores,
            paged_kv_indptr_buffer=self._graph_indptr[: bs + 1],
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs],
        )
        self._plan_graph(bs, req_pool_indices, seq_lens, ())
        if self._graph_indptr.device.type == "cuda":
            # plan() copied on this stream; the warm-up runs and the capture use another one.
            torch.cuda.current_stream(self._graph_indptr.device).synchronize()
        return _Planned(self._graph_wrappers[bs])

    def init_forward_metadata_replay(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: Sequence[int]
    ) -> None:
        """Gather this step's page table into the static buffers and re-plan wrapper ``bs``."""
        self._plan_graph(bs, req_pool_indices, seq_lens, seq_lens_cpu)

    def _plan_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: Sequence[int]
    ) -> None:
        b = len(seq_lens_cpu)
        indptr = padded_decode_indptr(seq_lens_cpu, bs)
        total = indptr[-1]
        if total > self._graph_indices.numel():  # unreachable while every length <= max_context_len
            raise ValueError(f"decode graph step of {total} pages exceeds the {self._graph_indices.numel()} reserved")
        real = indptr[b]
        gather_page_indices(
            self._graph_indices, self.req_to_token_pool.req_to_token, req_pool_indices[:b], seq_lens[:b], real, bs - b
        )
        # plan() copies indptr and last_page_len into the wrapper's buffers; indices is already
        # in place (flashinfer copies indices onto its buffer's own prefix: the same memory).
        self._plan(
            self._graph_wrappers[bs],
            torch.tensor(indptr, dtype=torch.int32),
            self._graph_indices[:total],
            self._graph_ones[:bs],
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            1,
            **self._plan_kwargs(),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        return self.attend(q, layer_id, batch)

    # With the fused kernels the model rotates q and k and stores K/V itself (one triton kernel,
    # app.engine.attention.AttendStoredKV) and calls attend: the pool's tensors are the pages.
    # Through torch the store took an index kernel and a cast per K and V (~1.4 ms of a 16 x 512
    # prefill step of the 1B on the H200, beside 0.44 ms for the fused rotary-and-store).

    def layer_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s K and V caches, ``[num_slots, num_kv_heads, head_dim]`` each."""
        return self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """:meth:`forward` without the store: the step's K/V are already at ``batch.out_cache_loc``."""
        planned: _Planned = batch.attn_metadata
        return planned.wrapper.run(q.contiguous(), self._paged[layer_id])
