"""Paged decode attention in triton: one query token per sequence over its cached context, split-KV.

A decode step has one query per sequence, so parallelism over (sequence, head) alone leaves most
of a GPU idle at small batch; the context is therefore cut into splits processed in parallel::

    context of seq b (seq_len tokens, slots via req_to_token[req_pool_indices[b], :])
    |<-- split 0 -->|<-- split 1 -->|<-- split 2 -->|   num_kv_splits[b] = 3 (<= max_kv_splits)
          |                 |               |
    stage 1: per (b, kv_head, split): the q heads sharing that kv head attend that split
             -> partial output o_s (already divided by its own softmax sum) and lse_s (log2 domain)
    stage 2: per (b, head): out = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max)

The grid of stage 1 is always ``(batch, num_kv_heads, max_kv_splits)``, whatever the lengths:
programs whose split lies past the sequence's ``num_kv_splits[b]`` (or past its end) do nothing,
and stage 2 masks them out. No launch depends on device data, so both stages can be captured in
a CUDA graph. Split sizes are ``ceil(seq_len / num_kv_splits[b])``, computed in the kernels from
the per-sequence split count: one per ``min_split_len`` tokens, capped by the grid
(:func:`num_kv_splits_for`'s rule), which the kernels apply to the lengths themselves unless a
caller passes the counts (so a decode step, and a graph replay, has no split tensor to prepare).

GQA: a stage-1 program loads each K/V block once for all ``num_heads // num_kv_heads`` q heads
of its kv head (a ``[BLOCK_H, D] x [D, BLOCK_N]`` dot, heads padded to at least 16 rows).

One kernel instead of two (a decode step launches each stage once per layer, and at small batch
a launch costs about what the stage does):

* ``max_kv_splits == 1`` (large batches: the backend's split cap is 1 from 33 sequences on the
  H200): stage 1 writes ``acc / l`` to the output directly, exactly what stage 2 would compute
  from one split; no partial buffers, no stage 2.
* ``reduce_in_stage1`` (``fused-split-reduce``): every stage-1 program of a (sequence, kv head)
  takes a ticket from a counter when its partial is stored; the program that draws the last
  ticket merges the splits as stage 2 would (for the q heads of that kv head) and puts the counter
  back to 0. The partials are written before the ticket (a block barrier, then a release
  atomic) and read after it (acquire, bypassing L1), the order that makes another program's
  stores visible. The counters (``[B, num_kv_heads]`` int32, zero) outlive the call, so a CUDA
  graph can replay it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from app.kernels.checks import check_one_device, check_output, check_paged_attention, dot_operand_dtype

LOG2E = 1.4426950408889634
DEFAULT_MAX_KV_SPLITS = 16
DEFAULT_MIN_SPLIT_LEN = 64  # tokens; shorter contexts use fewer splits (less stage-2 work)
DEFAULT_BLOCK_N = 64


@triton.jit
def _decode_stage1_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    req_to_token_ptr,
    req_idx_ptr,
    seq_lens_ptr,
    num_splits_ptr,  # unless SPLITS_FROM_LEN: [B] split counts
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,  # DIRECT, REDUCE: the output [B, H, D]
    counter_ptr,  # REDUCE: [B, num_kv_heads] int32 tickets, zero between launches
    step_slots_ptr,  # STEP_SLOTS: int32 [>= B, stride_ssb]: split s's slots at s * split_cap on
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    min_split_len,  # SPLITS_FROM_LEN: one split per this many tokens
    stride_qb,
    stride_qh,
    stride_cs,
    stride_ch,
    stride_rt,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_ssb,
    split_cap,  # STEP_SLOTS: a split's columns of step_slots (its most keys, in whole blocks)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EARLY_V: tl.constexpr,  # load V beside K (more bytes in flight, more registers)
    PREFETCH_SLOTS: tl.constexpr,  # load the next block's slots during this block (K/V addresses known at its start)
    DIRECT: tl.constexpr,  # one split (the grid's split dim is 1): write the output itself
    REDUCE: tl.constexpr,  # the last program of a (b, kv_head) merges the splits (see the module doc)
    MAX_SPLITS: tl.constexpr,
    SPLITS_FROM_LEN: tl.constexpr,  # the split count from seq_len (num_kv_splits_for's rule), not loaded
    TRIGGER: tl.constexpr,  # let the kernel after it (a programmatic dependent: o, or stage 2) start now
    STEP_SLOTS: tl.constexpr = 0,  # 1: also store each split's slots in step_slots; 2: read them from there
    BLOCK_S: tl.constexpr = 16,  # REDUCE: MAX_SPLITS rounded up to a power of two
    MERGE_H: tl.constexpr = 4,  # REDUCE: GROUP rounded up to a power of two
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    if SPLITS_FROM_LEN:
        num_splits = tl.minimum(tl.maximum(tl.cdiv(seq_len, min_split_len), 1), MAX_SPLITS)
    else:
        num_splits = tl.load(num_splits_ptr + b).to(tl.int32)
    split_len = tl.cdiv(seq_len, num_splits)
    start = split * split_len  # >= seq_len for every split >= num_splits: empty
    end = tl.minimum(start + split_len, seq_len)

    h_offs = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + h_offs
    h_mask = h_offs < GROUP
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    row_ptr = req_to_token_ptr + tl.load(req_idx_ptr + b).to(tl.int64) * stride_rt
    kv_base = kv_head.to(tl.int64) * stride_ch

    # STEP_SLOTS: the split's slots as the step's first layer stored them, at an address that
    # waits for no load (the table's row needs req_idx, the split's start seq_len): its first
    # block's load goes out beside the length's, one round trip before K and V instead of two.
    step_row = step_slots_ptr + b.to(tl.int64) * stride_ssb + split * split_cap
    # Where position p's slot is read inside the loop: the table's row, or the split's recorded run.
    slots_at = step_row - start if STEP_SLOTS == 2 else row_ptr
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    if STEP_SLOTS == 2:  # unmasked: past the split's end (stale entries) every K/V load is masked
        slots_next = tl.load(step_row + tl.arange(0, BLOCK_N)).to(tl.int64)
    elif PREFETCH_SLOTS:  # the first block's slots; each iteration then loads the next block's
        first = start + tl.arange(0, BLOCK_N)
        slots_next = tl.load(row_ptr + first, mask=first < end, other=0).to(tl.int64)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        # Past the end the slot reads as 0, the pool's dummy slot: finite K/V, masked below.
        if PREFETCH_SLOTS or STEP_SLOTS == 2:
            slots = slots_next
        else:
            slots = tl.load(row_ptr + pos, mask=n_mask, other=0).to(tl.int64)
        if STEP_SLOTS == 1:
            tl.store(step_row - start + pos, slots.to(tl.int32), mask=n_mask)
        kv_offs = slots[:, None] * stride_cs + kv_base + dims[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if EARLY_V:
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if PREFETCH_SLOTS or STEP_SLOTS == 2:  # after this block's K (and V): its loads are issued first
            following = pos + BLOCK_N
            slots_next = tl.load(slots_at + following, mask=following < end, other=0).to(tl.int64)
        qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # finite: each block's first position is valid
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if not EARLY_V:
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        p = p.to(v.dtype).to(DOT_DTYPE)  # rounded to the cache dtype as a tensor-core dot would
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    l_i = tl.where(l_i > 0, l_i, 1.0)  # empty split: l = 0; keep its (unstored) numbers finite
    out_rows = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :]
    if DIRECT:  # the only split: stage 2 would divide by a weight of exactly 1 (no split: zeros)
        tl.store(out_rows, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        # Only non-empty splits write (a per-head vector mask: the interpreter rejects scalar & vector).
        write = h_mask & (h_offs * 0 + start < end)
        mid = b.to(tl.int64) * stride_mob + heads * stride_moh + split * stride_mos
        lse_rows = mid_lse_ptr + b.to(tl.int64) * stride_mlb + heads * stride_mlh
        tl.store(mid_o_ptr + mid[:, None] + dims[None, :], acc / l_i[:, None], mask=write[:, None] & d_mask[None, :])
        tl.store(lse_rows + split, m_i + tl.log2(l_i), mask=write)
        if REDUCE:
            tl.debug_barrier()  # every thread's partial stored before the ticket releases them
            counter = counter_ptr + b.to(tl.int64) * stride_cb + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == MAX_SPLITS - 1:
                tl.debug_barrier()  # the others' partials, acquired by the ticket, for every thread
                tl.store(counter, 0)  # every program of this launch has drawn: ready for the next
                # Stage 2 for this kv head's q heads, every split at once (one round trip of loads,
                # not one a split), by the same rule for which splits were written.
                s = tl.arange(0, BLOCK_S)
                g = tl.arange(0, MERGE_H)
                merge_heads = kv_head * GROUP + g
                written = ((s[:, None] < num_splits) & (s[:, None] < MAX_SPLITS) & (s[:, None] * split_len < seq_len)
                           & (g[None, :] < GROUP))  # [splits, heads]
                lse_offs = b.to(tl.int64) * stride_mlb + merge_heads[None, :] * stride_mlh + s[:, None]
                lse = tl.load(mid_lse_ptr + lse_offs, mask=written, other=float("-inf"), cache_modifier=".cg")
                part_offs = (b.to(tl.int64) * stride_mob + merge_heads[None, :, None] * stride_moh
                             + s[:, None, None] * stride_mos + dims[None, None, :])
                parts = tl.load(mid_o_ptr + part_offs, mask=written[:, :, None] & d_mask[None, None, :], other=0.0,
                                cache_modifier=".cg")
                m = tl.max(lse, axis=0)
                m = tl.where(m == float("-inf"), 0.0, m)  # no split at all (seq_len 0): zeros, not NaN
                w = tl.where(written, tl.exp2(lse - m[None, :]), 0.0)
                total = tl.sum(w, axis=0)
                merged = tl.sum(w[:, :, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)[:, None]
                merge_rows = o_ptr + b.to(tl.int64) * stride_ob + merge_heads[:, None] * stride_oh + dims[None, :]
                tl.store(merge_rows, merged.to(o_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] & d_mask[None, :])


@triton.jit
def _decode_stage2_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
    seq_lens_ptr,
    num_splits_ptr,
    min_split_len,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    MAX_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_FROM_LEN: tl.constexpr,
    TRIGGER: tl.constexpr,  # let a programmatic dependent start now (see decode_attention)
    PDL_WAIT: tl.constexpr = False,  # launched as stage 1's programmatic dependent: wait for it first
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    if PDL_WAIT:  # resident while stage 1 runs; nothing of this kernel's is read before stage 1 ends
        tl.extra.cuda.gdc_wait()
    if TRIGGER:  # after the wait: the o projection's early loads would slow stage 1
        tl.extra.cuda.gdc_launch_dependents()
    s = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    # Every split's partials are loaded at once, beside the sequence's length rather than after
    # it (the length decides which splits stage 1 wrote): one round trip, not two. Those it did
    # not write (stale, maybe NaN) are dropped by the selects below, never summed.
    in_grid = s < MAX_SPLITS
    lse_all = tl.load(mid_lse_ptr + b.to(tl.int64) * stride_mlb + head * stride_mlh + s, mask=in_grid,
                      other=float("-inf"))
    mid = b.to(tl.int64) * stride_mob + head * stride_moh + s * stride_mos
    parts_all = tl.load(mid_o_ptr + mid[:, None] + dims[None, :], mask=in_grid[:, None] & d_mask[None, :], other=0.0)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    if SPLITS_FROM_LEN:
        num_splits = tl.minimum(tl.maximum(tl.cdiv(seq_len, min_split_len), 1), MAX_SPLITS)
    else:
        num_splits = tl.load(num_splits_ptr + b).to(tl.int32)
    split_len = tl.cdiv(seq_len, num_splits)
    # The same emptiness rule as stage 1: only splits that stage 1 wrote count.
    s_mask = (s < num_splits) & in_grid & (s * split_len < seq_len)
    lse = tl.where(s_mask, lse_all, float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no split at all (seq_len 0): output zeros, not NaN
    w = tl.where(s_mask, tl.exp2(lse - m), 0.0)
    parts = tl.where(s_mask[:, None], parts_all, 0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + dims, out.to(o_ptr.dtype.element_ty), mask=d_mask)


def num_kv_splits_for(
    seq_lens: torch.Tensor, max_kv_splits: int = DEFAULT_MAX_KV_SPLITS, min_split_len: int = DEFAULT_MIN_SPLIT_LEN
) -> torch.Tensor:
    """Splits per sequence (int32, on seq_lens' device, no host sync): one per ``min_split_len``
    tokens, between 1 and ``max_kv_splits``. Computed once per step, shared by every layer."""
    if max_kv_splits < 1 or min_split_len < 1:
        raise ValueError(f"num_kv_splits_for: max_kv_splits and min_split_len must be >= 1, got "
                         f"{max_kv_splits}, {min_split_len}")
    splits = torch.div(seq_lens + (min_split_len - 1), min_split_len, rounding_mode="floor")
    return splits.clamp(1, max_kv_splits).to(torch.int32)


def step_slots_split_cap(context_len: int, max_kv_splits: int, min_split_len: int, block_n: int) -> int:
    """A split's columns in a ``step_slots`` buffer: its most keys under the kernels' split rule
    for contexts of up to ``context_len`` tokens (``min_split_len``, or the context over
    ``max_kv_splits`` splits), in whole ``block_n`` blocks."""
    longest = max(min_split_len, -(-context_len // max_kv_splits))
    return -(-longest // block_n) * block_n


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 attention stays float32 on tensor-core GPUs (no silent TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor | None,
    *,
    max_kv_splits: int = DEFAULT_MAX_KV_SPLITS,
    min_split_len: int = DEFAULT_MIN_SPLIT_LEN,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = 4,
    early_v: bool = False,
    num_stages: int | None = None,
    prefetch_slots: bool = False,
    reduce_in_stage1: bool = False,
    split_counters: torch.Tensor | None = None,
    trigger_dependents: bool = False,
    step_slots: torch.Tensor | None = None,
    record_step_slots: bool = False,
    stage2_pdl: bool = False,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, D]`` (one token per sequence) over each sequence's cached context.

    Sequence ``b`` attends keys/values at slots ``req_to_token[req_pool_indices[b], :seq_lens[b]]``
    of ``k_cache``/``v_cache`` ``[num_slots, KVH, D]`` (its own new token included: store it
    first). ``num_kv_splits`` ``[B]`` (see :func:`num_kv_splits_for`) must lie in
    ``[1, max_kv_splits]``; None: the kernels apply that rule to ``seq_lens`` themselves (with
    ``min_split_len``), so a step needs no split-count tensor (nor a graph replay a copy of one).
    ``max_kv_splits`` fixes the grid. ``scale`` defaults to 1/sqrt(D).
    Returns ``out`` (or a new ``[B, H, D]`` tensor) in q's dtype. Raises ValueError on
    mismatched shapes, dtypes or devices; values (lengths, slots) are not checked, to avoid syncs.

    ``block_n`` (keys per step), ``num_warps``, ``early_v`` (load each V block beside its K
    block instead of after the softmax) and ``num_stages`` (the software-pipelining depth of its
    key loop; None: triton's default) and ``prefetch_slots`` (each block loads the next block's
    KV slots, so that a block's K/V loads need not wait for its slots' load: a program walking
    many blocks paid two dependent memory round trips a block) are stage 1's launch knobs, for
    lab/tools/bench_decode_attention.py to sweep; the results are the same whatever they are.

    With ``max_kv_splits == 1`` stage 1 writes the output itself (one kernel, the same result).
    ``reduce_in_stage1``: the last stage-1 program of each (sequence, kv head) merges the splits
    (one kernel at any split count; see the module docstring); ``split_counters`` ``[>= B,
    num_kv_heads]`` int32, all zero, are its tickets, left zero again (a buffer of the caller's
    so that a CUDA graph can replay the call; None: a fresh one per call).

    ``trigger_dependents`` (CUDA, compute capability 9.0+): the attention's last kernel lets a
    kernel launched after it as a programmatic dependent start at once (``griddepcontrol.
    launch_dependents`` at its programs' start), so that the o projection's gemv (``pdl``
    "preload") loads its first weight tiles while the attention runs; the dependent still waits
    for the attention's end before reading its output. Without a dependent it changes nothing.

    ``step_slots`` (int32 ``[>= B, max_kv_splits * step_slots_split_cap(...)]`` of the table's
    row length, ``min_split_len`` and ``block_n``; split counts from the lengths only): the
    step's first layer passes ``record_step_slots`` and stores each split's KV slots there as it
    reads them from the table; every later layer of the step, called with the same lengths,
    splits and knobs, reads them from there (on the GPU one memory round trip less before its
    K/V loads: the table's row needs the request's index, the split's start its length, while a
    split's place in ``step_slots`` is known at launch). Stale entries past a split's end are
    never dereferenced.

    ``stage2_pdl`` (CUDA, compute capability 9.0+): stage 2 launches as a programmatic dependent
    of stage 1 (which lets it in as its programs start): its launch and its programs' start go
    under stage 1, and it waits for stage 1's end before it loads anything (with one split, or
    the merge in stage 1, there is no stage 2 and it changes nothing).
    """
    batch, num_heads, head_dim, num_kv_heads = check_paged_attention("decode_attention", q, k_cache, v_cache, req_to_token)
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens), ("num_kv_splits", num_kv_splits)):
        if t is not None and (t.shape != (batch,) or t.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"decode_attention: {name} must be int32/int64 [{batch}], got {tuple(t.shape)} {t.dtype}")
    if max_kv_splits < 1 or block_n < 16 or block_n & (block_n - 1) or num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"decode_attention: need max_kv_splits >= 1, block_n a power of two >= 16 and num_warps "
                         f"a power of two <= 16, got {max_kv_splits}, {block_n}, {num_warps}")
    if min_split_len < 1:
        raise ValueError(f"decode_attention: min_split_len must be >= 1, got {min_split_len}")
    if num_stages is not None and not 1 <= num_stages <= 8:
        raise ValueError(f"decode_attention: num_stages must be in 1..8 (or None), got {num_stages}")
    for name, on in (("trigger_dependents", trigger_dependents), ("stage2_pdl", stage2_pdl)):
        if on and q.device.type != "cuda":
            raise ValueError(f"decode_attention: {name} (programmatic dependent launch) needs a CUDA device, "
                             f"got {q.device}")
    out = check_output("decode_attention", out, q)
    tensors = (q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, out)
    check_one_device("decode_attention", tensors + ((num_kv_splits,) if num_kv_splits is not None else ()))
    from_len = num_kv_splits is None
    splits = seq_lens if num_kv_splits is None else num_kv_splits  # (not read when from_len)
    if batch == 0:
        return out

    direct = max_kv_splits == 1
    reduce = reduce_in_stage1 and not direct
    if reduce and split_counters is None:
        split_counters = torch.zeros((batch, num_kv_heads), dtype=torch.int32, device=q.device)
    if reduce and split_counters is not None and (  # (not None when reduce: for the type checker)
            split_counters.dim() != 2 or split_counters.shape[0] < batch or split_counters.shape[1] != num_kv_heads
            or split_counters.dtype != torch.int32 or split_counters.stride(1) != 1 or split_counters.device != q.device):
        raise ValueError(f"decode_attention: split_counters must be int32 [>= {batch}, {num_kv_heads}] on {q.device} "
                         f"with unit stride along heads, got {tuple(split_counters.shape)} {split_counters.dtype}")
    counters = split_counters if reduce and split_counters is not None else out
    split_cap = 0 if step_slots is None else step_slots_split_cap(req_to_token.shape[1], max_kv_splits,
                                                                   min_split_len, block_n)
    if step_slots is not None and (
            not from_len or step_slots.dim() != 2 or step_slots.shape[0] < batch
            or step_slots.shape[1] < max_kv_splits * split_cap or step_slots.dtype != torch.int32
            or step_slots.stride(1) != 1 or step_slots.device != q.device):
        raise ValueError(f"decode_attention: step_slots must be int32 [>= {batch}, >= {max_kv_splits * split_cap}] on "
                         f"{q.device} with unit stride, with split counts from the lengths (num_kv_splits None), got "
                         f"{tuple(step_slots.shape)} {step_slots.dtype}")
    if record_step_slots and step_slots is None:
        raise ValueError("decode_attention: record_step_slots needs a step_slots buffer")
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    if direct:  # no partials: the kernel's pointers to them are never used
        mid_o = mid_lse = out
    else:
        mid_o = torch.empty((batch, num_heads, max_kv_splits, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((batch, num_heads, max_kv_splits), dtype=torch.float32, device=q.device)
    qk_scale = (scale if scale is not None else 1.0 / math.sqrt(head_dim)) * LOG2E
    _decode_stage1_kernel[(batch, num_kv_heads, max_kv_splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, splits, mid_o, mid_lse, out, counters,
        step_slots if step_slots is not None else req_to_token, qk_scale, min_split_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), counters.stride(0) if reduce else 0,
        step_slots.stride(0) if step_slots is not None else 0, split_cap,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_DTYPE=dot_operand_dtype(k_cache.dtype, _decode_stage1_kernel),
        DOT_PRECISION=_dot_precision(k_cache.dtype),
        EARLY_V=early_v,
        PREFETCH_SLOTS=prefetch_slots,
        DIRECT=direct,
        REDUCE=reduce,
        MAX_SPLITS=max_kv_splits,
        SPLITS_FROM_LEN=from_len,
        # Stage 1 lets in the kernel after it: the o projection when it is the attention's last, else stage 2.
        TRIGGER=(trigger_dependents and (direct or reduce)) or (stage2_pdl and not (direct or reduce)),
        STEP_SLOTS=0 if step_slots is None else 1 if record_step_slots else 2,
        BLOCK_S=triton.next_power_of_2(max_kv_splits),
        MERGE_H=triton.next_power_of_2(group),
        num_warps=num_warps,
        **({"num_stages": num_stages} if num_stages is not None else {}),
    )
    if direct or reduce:
        return out
    _decode_stage2_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, seq_lens, splits, min_split_len,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        MAX_SPLITS=max_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(max_kv_splits),
        BLOCK_D=block_d,
        SPLITS_FROM_LEN=from_len,
        TRIGGER=trigger_dependents,
        PDL_WAIT=stage2_pdl,
        num_warps=4,
        # launch_pdl is passed only when on: triton's interpreter knows no such option.
        **({"launch_pdl": True} if stage2_pdl else {}),
    )
    return out
