"""Attention backend on our triton kernels: KV store, paged extend attention, split-KV decode.

Per step, ``init_forward_metadata`` prepares with device ops only (no host sync) what every layer
shares: for DECODE the split count of each sequence, for EXTEND the flattened list of query
blocks. Per layer, ``forward`` stores the new K/V and launches the attention kernels (``attend``, which
a model that stored the K/V itself calls alone); it never reads device values on the host. The decode launch grid depends only on the batch size and
``max_kv_splits``, so a decode step can be captured in a CUDA graph once its metadata tensors
live in static buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.engine.attention import AttentionBackend
from app.engine.forward_batch import ForwardBatch, ForwardMode
from app.engine.kv_pool import KVPool, ReqToTokenPool
from app.kernels.prefill_tiling import packs_query_groups
from app.kernels.triton_decode import (
    DEFAULT_MAX_KV_SPLITS,
    DEFAULT_MIN_SPLIT_LEN,
    decode_attention,
    step_slots_split_cap,
)
from app.kernels.triton_extend import ExtendBlocks, extend_attention, extend_blocks
from app.kernels.triton_kv_store import store_kv


# decode_step_slots serves decode steps of at most this many sequences: the latency-bound ones,
# where one memory round trip is a visible share of the attention's time (and the buffer stays
# small: a row per sequence as long as the request table's).
STEP_SLOTS_MAX_BATCH = 8


@dataclass(frozen=True, slots=True)
class TritonDecodeMetadata:
    req_pool_indices: torch.Tensor  # int64 [B]
    seq_lens: torch.Tensor  # int64 [B]: context length including the new token
    # The grid's split dim: a function of the batch size only (fixed per CUDA graph). Each
    # sequence's split count the kernels derive from its length (num_kv_splits_for's rule).
    max_kv_splits: int
    # decode_attention's step_slots (the backend's decode_step_slots, small batches): recorded
    # by the step's first layer, read by the others. None: every layer reads the table.
    step_slots: torch.Tensor | None = None


def split_cap_for(batch_size: int, num_kv_heads: int, target_programs: int, max_kv_splits: int) -> int:
    """:meth:`TritonAttentionBackend.decode_split_cap`'s rule (also timed by
    lab/tools/bench_decode_attention.py): splits enough for ``target_programs`` programs, or for
    twice that where the batch's (sequence, kv head) pairs alone are at most half of it."""
    per_split = batch_size * num_kv_heads
    target = target_programs * (2 if 2 * per_split <= target_programs else 1)
    return max(1, min(max_kv_splits, -(-target // per_split)))


def decode_block_n_for(batch_size: int, num_kv_heads: int, head_dim: int, split_cap: int, target_programs: int | None,
                       block_n: int) -> int:
    """Keys a step of the decode loop for a batch (the rule of
    :meth:`TritonAttentionBackend.decode_launch`): 128 where each sequence gets at most two splits
    and the (sequence, kv head) pairs are at most twice ``target_programs`` (on CUDA, head_dim up
    to 64), else ``block_n``. There every program walks a long context with few neighbours on its
    SM, so its latency is the kernel's: half the loop steps. On the H200 at the 1B's head_dim 64
    (lab/tools/bench_decode_attention.py) the wider block won from 32 to 64 sequences and lost
    from 96 (about 10 % at 128 and 256), so the rule stops at twice the target."""
    pairs = batch_size * num_kv_heads
    if target_programs is not None and head_dim <= 64 and split_cap <= 2 and pairs <= 2 * target_programs:
        return max(block_n, 128)
    return block_n


@dataclass(frozen=True, slots=True)
class TritonExtendMetadata:
    req_pool_indices: torch.Tensor  # int64 [B]
    prefix_lens: torch.Tensor  # int64 [B]
    extend_lens: torch.Tensor  # int64 [B]
    blocks: ExtendBlocks  # query blocks of BLOCK_M new tokens, flattened over the batch


class TritonAttentionBackend(AttentionBackend):
    """Paged attention over ``kv_pool`` and ``req_to_token_pool`` with our triton kernels.

    Decode splits: a batch of B sequences launches a grid of (B, kv heads, S) stage-1 programs,
    where S = :meth:`decode_split_cap` (B) depends on B alone, never on lengths, so a CUDA graph
    captured for B stays valid: S is at most ``max_kv_splits`` and no more than it takes to fill
    ``target_programs`` programs (default: two per SM on CUDA, no cap elsewhere), since a large
    batch has parallelism enough and every split costs a partial result written and merged; a
    batch whose (sequence, kv head) pairs alone are at most half the target (under one program
    an SM) aims for twice the target instead (see :meth:`decode_split_cap`).
    Within that, a sequence uses one split per ``min_split_len`` tokens of its context.
    ``decode_block_n``: the keys a step of the decode loop at every batch (default:
    :meth:`decode_launch`'s rule: ``block_n``, the prefill's, or 128 at mid batches);
    ``decode_warps``: its warps a program at every batch (default: :meth:`decode_num_warps`'s rule);
    ``decode_num_stages``, ``decode_early_v`` and ``decode_prefetch_slots``: decode_attention's
    ``num_stages``, ``early_v`` and ``prefetch_slots`` (default: on CUDA only).
    ``decode_step_slots`` (default: on CUDA only): decode steps of up to STEP_SLOTS_MAX_BATCH
    sequences pass decode_attention a ``step_slots`` buffer (allocated here once, so that every
    CUDA graph reads the same one): layer 0 records each split's KV slots there, the later
    layers read them without the table's round trip. ``decode_stage2_pdl`` (default: on CUDA
    devices of compute capability 9.0 or newer, which it needs): stage 2 launches as a
    programmatic dependent of stage 1 (decode_attention's ``stage2_pdl``).

    ``reduce_in_stage1`` (``fused-split-reduce``): the splits are merged by the last stage-1
    program of each sequence and kv head instead of a second kernel (triton_decode.py), with
    tickets in one counter buffer of a row per request-table row, allocated here once so that
    every CUDA graph reads the same one.

    Prefill tiling: with ``num_heads`` given (the model's query heads), :func:`packs_query_groups`
    picks programs of a KV head's whole query group over 64 // group queries (one K/V load a
    group) on CUDA at head_dim <= 64, else 64 queries of one head; ``extend_block_m`` and
    ``extend_pack_gqa`` override it.
    """

    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
        *,
        scale: float | None = None,
        num_heads: int | None = None,
        max_kv_splits: int = DEFAULT_MAX_KV_SPLITS,
        min_split_len: int = DEFAULT_MIN_SPLIT_LEN,
        target_programs: int | None = None,
        extend_block_m: int | None = None,
        extend_pack_gqa: bool | None = None,
        block_n: int | None = None,
        decode_block_n: int | None = None,
        decode_warps: int | None = None,
        decode_num_stages: int | None = None,
        decode_early_v: bool = False,
        decode_prefetch_slots: bool | None = None,
        reduce_in_stage1: bool = False,
        trigger_dependents: bool = False,
        decode_step_slots: bool | None = None,
        decode_stage2_pdl: bool | None = None,
    ) -> None:
        if max_kv_splits < 1 or min_split_len < 1 or (target_programs is not None and target_programs < 1):
            raise ValueError(f"TritonAttentionBackend: max_kv_splits, min_split_len and target_programs must be "
                             f">= 1, got {max_kv_splits}, {min_split_len}, {target_programs}")
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.scale = scale  # None: 1/sqrt(head_dim)
        self.max_kv_splits = max_kv_splits
        self.min_split_len = min_split_len
        if target_programs is None and kv_pool.device.type == "cuda":
            target_programs = 2 * torch.cuda.get_device_properties(kv_pool.device).multi_processor_count
        self.target_programs = target_programs
        self.num_kv_heads = kv_pool.k[0].shape[1]
        head_dim = kv_pool.k[0].shape[-1]
        # Keys per block: 64 keeps a [64, head_dim] K and V tile in registers up to head_dim 128.
        self.block_n = block_n if block_n is not None else (64 if head_dim <= 128 else 32)
        self.head_dim = head_dim
        self.decode_block_n = decode_block_n  # decode steps only; None: decode_launch's rule by batch
        self.decode_warps = decode_warps
        self.decode_num_stages = decode_num_stages
        self.decode_early_v = decode_early_v
        # Each key block loading the next block's slots: the default on CUDA, where it hides the
        # table's round trip behind the block before (long single sequences gain most).
        self.decode_prefetch_slots = (kv_pool.device.type == "cuda" if decode_prefetch_slots is None
                                      else decode_prefetch_slots)
        # Query heads per KV head: known only where the model's head count is given (num_heads).
        group = num_heads // self.num_kv_heads if num_heads is not None else 1
        packs = packs_query_groups(head_dim, group, kv_pool.device.type)
        self.extend_pack_gqa = packs if extend_pack_gqa is None else extend_pack_gqa
        self.extend_block_m = extend_block_m if extend_block_m is not None else (
            max(16, 64 // group) if self.extend_pack_gqa else 64)
        self.extend_num_stages = 2 if self.extend_pack_gqa and kv_pool.device.type == "cuda" else None
        self.reduce_in_stage1 = reduce_in_stage1
        # Decode attention lets the o projection launched after it as a programmatic dependent
        # start early (decode_attention's trigger_dependents; with gemv-pdl-mode o=preload).
        self.trigger_dependents = trigger_dependents
        # The splits' slots recorded by layer 0 for the others: the default on CUDA (faster at
        # batch 1 on the H200: the later layers skip the table's round trip).
        on = kv_pool.device.type == "cuda" if decode_step_slots is None else decode_step_slots
        self._step_slots = self._step_slots_buffer() if on else None
        # Stage 2 as stage 1's programmatic dependent: the default where it can be (Hopper and newer;
        # a small gain at batch 1 on the H200).
        capable = kv_pool.device.type == "cuda" and torch.cuda.get_device_capability(kv_pool.device) >= (9, 0)
        if decode_stage2_pdl and not capable:
            raise ValueError(f"TritonAttentionBackend: decode_stage2_pdl (programmatic dependent launch) needs a CUDA "
                             f"device of compute capability 9.0 or newer, got {kv_pool.device}")
        self.decode_stage2_pdl = capable if decode_stage2_pdl is None else decode_stage2_pdl
        # Its tickets: a decode batch has at most one sequence per request-table row.
        self._split_counters = (
            torch.zeros((req_to_token_pool.req_to_token.shape[0], self.num_kv_heads), dtype=torch.int32,
                        device=kv_pool.device) if reduce_in_stage1 else None
        )

    def _step_slots_buffer(self) -> torch.Tensor:
        """decode_attention's ``step_slots`` for every batch size up to STEP_SLOTS_MAX_BATCH, at
        the widest of their split caps and blocks (zeros: the pool's dummy slot, never stale
        garbage)."""
        context = self.req_to_token_pool.req_to_token.shape[1]
        columns = 0
        for bs in range(1, STEP_SLOTS_MAX_BATCH + 1):
            cap = self.decode_split_cap(bs)
            block_n, _ = self.decode_launch(bs, cap)
            columns = max(columns, cap * step_slots_split_cap(context, cap, self.min_split_len, block_n))
        return torch.zeros((STEP_SLOTS_MAX_BATCH, columns), dtype=torch.int32, device=self.kv_pool.device)

    def _decode_metadata(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, bs: int) -> TritonDecodeMetadata:
        step_slots = self._step_slots if bs <= STEP_SLOTS_MAX_BATCH else None
        return TritonDecodeMetadata(req_pool_indices, seq_lens, self.decode_split_cap(bs), step_slots)

    def init_forward_metadata(self, batch: ForwardBatch) -> TritonDecodeMetadata | TritonExtendMetadata:
        if batch.mode is ForwardMode.DECODE:
            return self._decode_metadata(batch.req_pool_indices, batch.seq_lens, batch.batch_size)
        blocks = extend_blocks(batch.extend_lens, batch.extend_lens_cpu, self.extend_block_m)
        return TritonExtendMetadata(batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, blocks)

    # ------------------------------------------------------------------ CUDA graphs (prefill)
    # app.engine.prefill_graph.PrefillGraphBackend: the graph of N tokens reads the sequence's row
    # and lengths from the runner's static buffers; its grid covers N tokens' query blocks, and
    # the kernel skips the blocks past the real extend length it reads.

    def init_extend_metadata_static(self, num_tokens: int, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                                    extend_lens: torch.Tensor) -> TritonExtendMetadata:
        block_m = self.extend_block_m
        num_blocks = -(-num_tokens // block_m)
        device = extend_lens.device
        blocks = ExtendBlocks(torch.zeros(1, dtype=torch.int64, device=device),
                              torch.zeros(num_blocks, dtype=torch.int64, device=device),
                              torch.arange(num_blocks, dtype=torch.int64, device=device) * block_m, num_blocks, block_m)
        return TritonExtendMetadata(req_pool_indices, prefix_lens, extend_lens, blocks)

    # ------------------------------------------------------------------ CUDA graphs (decode)
    # app.engine.cuda_graph.DecodeGraphBackend: the graph of size bs reads req_pool_indices and
    # seq_lens from the runner's static buffers (the split counts follow from the lengths in the
    # kernels); its grid's split dim is decode_split_cap(bs), fixed at capture.

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """With ``reduce_in_stage1``, tickets for graphs of up to ``max_bs`` sequences."""
        if self._split_counters is not None and self._split_counters.shape[0] < max_bs:  # before any capture
            self._split_counters = torch.zeros((max_bs, self.num_kv_heads), dtype=torch.int32, device=self.kv_pool.device)

    def init_forward_metadata_capture(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> TritonDecodeMetadata:
        return self._decode_metadata(req_pool_indices, seq_lens, bs)

    def init_forward_metadata_replay(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: Sequence[int]
    ) -> None:
        """Nothing to fill: the graph reads the lengths the runner copied in, and the kernels
        derive each sequence's split count from its length (padded rows, seq_len 0: one split,
        reading nothing)."""

    def decode_split_cap(self, batch_size: int) -> int:
        """The decode grid's split dim for ``batch_size`` sequences (a host int: no sync).

        Enough splits for ``target_programs`` programs (two an SM by default), or for twice that
        where the batch alone would fill under one program an SM. On the H200 at the 1B's shape
        (lab/tools/bench_decode_attention.py) twice the two-an-SM cap won at 4 and 16 sequences and
        lost at 32 and 64: the split pays only while SMs would otherwise idle."""
        if self.target_programs is None:
            return self.max_kv_splits
        return split_cap_for(batch_size, self.num_kv_heads, self.target_programs, self.max_kv_splits)

    def decode_tiling(self) -> str:
        extra = "".join(f",{name}={value}" for name, value in (
            ("warps", self.decode_warps), ("stages", self.decode_num_stages)) if value is not None)
        extra += ",early_v" if self.decode_early_v else ""
        extra += ",prefetch_slots" if self.decode_prefetch_slots else ""
        extra += ",step_slots" if self._step_slots is not None else ""
        extra += ",stage2_pdl" if self.decode_stage2_pdl else ""
        block_n: int | str | None = self.decode_block_n
        if block_n is None:  # the rule's two answers, where it has two (a batch of one at one split: its wider one)
            wider = decode_block_n_for(1, self.num_kv_heads, self.head_dim, 1, self.target_programs, self.block_n)
            block_n = self.block_n if wider == self.block_n else f"{self.block_n}/{wider}"
        return f"splits={self.max_kv_splits},min_len={self.min_split_len},block_n={block_n}{extra}"

    def decode_launch(self, batch_size: int, split_cap: int) -> tuple[int, int]:
        """``(block_n, num_warps)`` of the decode kernels for ``batch_size`` sequences at
        ``split_cap`` (host ints, fixed per CUDA graph): the knobs where given, else
        :func:`decode_block_n_for` and :meth:`decode_num_warps`."""
        block_n = self.decode_block_n or decode_block_n_for(
            batch_size, self.num_kv_heads, self.head_dim, split_cap, self.target_programs, self.block_n)
        return block_n, self.decode_warps or self.decode_num_warps(split_cap, block_n)

    @staticmethod
    def decode_num_warps(split_cap: int, block_n: int = 64) -> int:
        """Warps per decode program: 4 with blocks of 128 keys or more; else 2 where each
        sequence gets one split (large batches, whose grid alone fills the GPU: smaller programs
        keep more of them resident), else 4. On the H200 at head_dim 64
        (lab/tools/bench_decode_attention.py) 2 warps were about 10 % faster at 64 to 256 sequences
        of one split and slower at batch 1 (16 splits); at head_dim 128 they changed nothing. A
        [128, 64] K and V tile wants 4."""
        return 4 if block_n >= 128 or split_cap != 1 else 2

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.layer_cache(layer_id)
        store_kv(k_cache, v_cache, batch.out_cache_loc, k, v)
        return self.attend(q, layer_id, batch)

    # A model may store the new tokens' K/V itself (fused-decode: the rotary kernel writes them
    # to layer_cache at batch.out_cache_loc) and call attend instead of forward.

    def layer_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s K and V caches, ``[num_slots, num_kv_heads, head_dim]`` each."""
        return self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """:meth:`forward` without the store: the step's K/V are already at ``batch.out_cache_loc``."""
        k_cache, v_cache = self.layer_cache(layer_id)
        table = self.req_to_token_pool.req_to_token
        meta = batch.attn_metadata
        if isinstance(meta, TritonDecodeMetadata):
            block_n, num_warps = self.decode_launch(meta.req_pool_indices.shape[0], meta.max_kv_splits)
            return decode_attention(
                q, k_cache, v_cache, table, meta.req_pool_indices, meta.seq_lens, None,
                max_kv_splits=meta.max_kv_splits, min_split_len=self.min_split_len, scale=self.scale,
                block_n=block_n, num_warps=num_warps,
                num_stages=self.decode_num_stages, early_v=self.decode_early_v,
                prefetch_slots=self.decode_prefetch_slots,
                reduce_in_stage1=self.reduce_in_stage1, split_counters=self._split_counters,
                trigger_dependents=self.trigger_dependents,
                step_slots=meta.step_slots, record_step_slots=meta.step_slots is not None and layer_id == 0,
                stage2_pdl=self.decode_stage2_pdl,
            )
        return extend_attention(
            q, k_cache, v_cache, table, meta.req_pool_indices, meta.prefix_lens, meta.extend_lens, meta.blocks,
            scale=self.scale, block_n=self.block_n, num_stages=self.extend_num_stages,
            pack_gqa=self.extend_pack_gqa,
        )
