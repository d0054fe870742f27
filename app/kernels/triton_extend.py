"""Extend (prefill) attention in triton: new tokens attend their cached prefix and each other, causally.

The new tokens of all sequences are packed back to back (see ``ForwardBatch``); their K/V are
already stored in the pool, so every key, prefix or new, is read through the request table::

    seq b: prefix_len p, extend_len e, queries q[q_start[b] : q_start[b] + e] at positions p .. p+e-1
    keys:  slots req_to_token[req_pool_indices[b], 0 : p + e]
    query at position p + i sees keys 0 .. p + i

    query blocks (BLOCK_M queries of one sequence each), flattened over the batch:
      block:      0        1        2      3
      seq:        0        0        1      2         <- block_seq
      first q:    0       BLOCK_M   0      0         <- block_start (offset within the sequence)

One program per (query block, q head), or with ``pack_gqa`` per (query block, kv head) over all
the q heads that share it. Its keys split into a part every query of the block sees
(positions < p + block_start: no causal mask) and the diagonal part (causal mask). The block list
is built once per step by :func:`extend_blocks` with device ops; only its length comes from the
host-side extend lengths, so there is no device sync.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from app.kernels.checks import check_one_device, check_output, check_paged_attention, dot_operand_dtype

LOG2E = 1.4426950408889634
DEFAULT_BLOCK_M = 64
DEFAULT_BLOCK_N = 64


@triton.jit
def _attend_block(
    q,
    m_i,
    l_i,
    acc,
    n0,
    kv_end,
    row_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_base,
    stride_cs,
    q_pos,
    qk_scale,
    dims,
    d_mask,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of (m_i, l_i, acc) with keys at positions [n0, min(n0 + BLOCK_N, kv_end))."""
    pos = n0 + tl.arange(0, BLOCK_N)
    n_mask = pos < kv_end
    # Past kv_end the slot reads as 0, the pool's dummy slot: finite K/V, masked below.
    slots = tl.load(row_ptr + pos, mask=n_mask, other=0).to(tl.int64)
    kv_offs = slots[:, None] * stride_cs + kv_base + dims[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
    visible = n_mask[None, :]
    if CAUSAL:
        visible = visible & (pos[None, :] <= q_pos[:, None])
    qk = tl.where(visible, qk, float("-inf"))
    # Finite: key 0 (or the block's first key) is visible to every query row, padded rows included.
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
    p = p.to(v.dtype).to(DOT_DTYPE)  # rounded to the cache dtype as a tensor-core dot would
    acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    o_ptr,
    req_to_token_ptr,
    req_idx_ptr,
    prefix_lens_ptr,
    extend_lens_ptr,
    q_start_ptr,
    block_seq_ptr,
    block_start_ptr,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cs,
    stride_ch,
    stride_rt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PACK_GQA: tl.constexpr,  # one program per (query block, kv head): its GROUP q heads share K/V loads
    ROWS: tl.constexpr,  # BLOCK_M, or GROUP * BLOCK_M with PACK_GQA (rows head-major: head, then query)
):
    blk = tl.program_id(0)
    if PACK_GQA:
        kv_head = tl.program_id(1)
        first_head = kv_head * GROUP
    else:
        first_head = tl.program_id(1)
        kv_head = first_head // GROUP
    b = tl.load(block_seq_ptr + blk)
    m0 = tl.load(block_start_ptr + blk).to(tl.int32)
    prefix = tl.load(prefix_lens_ptr + b).to(tl.int32)
    extend = tl.load(extend_lens_ptr + b).to(tl.int32)
    q0 = tl.load(q_start_ptr + b).to(tl.int64)

    rows = tl.arange(0, ROWS)
    offs_m = m0 + rows % BLOCK_M
    heads = first_head + rows // BLOCK_M
    m_mask = offs_m < extend
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (q0 + offs_m)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    q_pos = prefix + offs_m
    row_ptr = req_to_token_ptr + tl.load(req_idx_ptr + b).to(tl.int64) * stride_rt
    kv_base = kv_head.to(tl.int64) * stride_ch

    m_i = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    # Keys before the block's first query position: visible to every query of the block. A block
    # past the sequence's new tokens (a prefill graph's padding: app/engine/prefill_graph.py)
    # attends to nothing and stores nothing.
    live = m0 < extend
    full_end = tl.where(live, prefix + m0, 0)
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, n0, full_end, row_ptr, k_cache_ptr, v_cache_ptr, kv_base, stride_cs, q_pos,
            qk_scale, dims, d_mask, False, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
        )
    # The diagonal: keys up to the block's last query position, causally masked.
    kv_end = tl.where(live, prefix + tl.minimum(m0 + BLOCK_M, extend), 0)
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, n0, kv_end, row_ptr, k_cache_ptr, v_cache_ptr, kv_base, stride_cs, q_pos,
            qk_scale, dims, d_mask, True, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
        )

    out = acc / l_i[:, None]
    tl.store(
        o_ptr + (q0 + offs_m)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


class ExtendBlocks(NamedTuple):
    """The flattened query-block list of one EXTEND step (see the module diagram)."""

    q_start: torch.Tensor  # int64 [B]: index of each sequence's first new token in the packed q
    block_seq: torch.Tensor  # int64 [num_blocks]: the sequence of each query block
    block_start: torch.Tensor  # int64 [num_blocks]: its first query, counted within the sequence
    num_blocks: int  # from the host-side extend lengths, so launching needs no device sync
    block_m: int  # queries per block: the kernel's BLOCK_M


def extend_blocks(extend_lens: torch.Tensor, extend_lens_cpu: Sequence[int], block_m: int = DEFAULT_BLOCK_M) -> ExtendBlocks:
    """Query blocks of ``block_m`` tokens for ``extend_lens`` (device) / ``extend_lens_cpu`` (host copy).

    Device ops only (no sync); call once per step and share the result across layers.
    """
    if extend_lens.dim() != 1 or extend_lens.shape[0] != len(extend_lens_cpu) or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"extend_blocks: need matching [B] extend lengths and block_m a power of two >= 16, got "
                         f"{tuple(extend_lens.shape)}, {len(extend_lens_cpu)}, {block_m}")
    device = extend_lens.device
    extend = extend_lens.to(torch.int64)
    q_start = torch.cumsum(extend, 0) - extend
    per_seq = torch.div(extend + (block_m - 1), block_m, rounding_mode="floor")
    num_blocks = sum(-(-e // block_m) for e in extend_lens_cpu)
    block_seq = torch.repeat_interleave(
        torch.arange(extend.shape[0], device=device), per_seq, output_size=num_blocks
    )
    first_block = torch.cumsum(per_seq, 0) - per_seq
    block_start = (torch.arange(num_blocks, device=device) - first_block[block_seq]) * block_m
    return ExtendBlocks(q_start, block_seq, block_start, num_blocks, block_m)


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 attention stays float32 on tensor-core GPUs (no silent TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    blocks: ExtendBlocks,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = 4,
    num_stages: int | None = None,
    pack_gqa: bool = False,
) -> torch.Tensor:
    """Causal attention of the packed new tokens ``q`` ``[T, H, D]`` over prefix + new keys.

    Sequence ``b`` owns queries ``blocks.q_start[b] ...`` (``extend_lens[b]`` of them, at positions
    ``prefix_lens[b] ...``) and keys at slots ``req_to_token[req_pool_indices[b], :prefix + extend]``
    of ``k_cache``/``v_cache`` ``[num_slots, KVH, D]`` (the new tokens' K/V stored first).
    ``blocks`` comes from :func:`extend_blocks` and sets the query block size. Returns ``out`` (or a
    new ``[T, H, D]``) in q's dtype. ``block_n`` (keys per step), ``num_warps`` and ``num_stages``
    (software pipelining of the key loop; None: 3, or 2 for float32 tiles) are launch knobs, and
    so is ``pack_gqa``: one program per (query block, kv head) whose q heads share each K/V
    load (a tile of q heads x block_m rows; with grouped-query attention the K/V are read once
    per group instead of once per q head); lab/tools/bench_extend_attention.py sweeps them. Raises
    ValueError on mismatched shapes, dtypes or devices and bad knobs; values (lengths, slots) are
    not checked, to avoid device syncs.
    """
    num_tokens, num_heads, head_dim, num_kv_heads = check_paged_attention("extend_attention", q, k_cache, v_cache, req_to_token)
    batch = req_pool_indices.shape[0] if req_pool_indices.dim() == 1 else -1
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens),
                    ("extend_lens", extend_lens), ("blocks.q_start", blocks.q_start)):
        if t.shape != (batch,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"extend_attention: {name} must be int32/int64 [B] like req_pool_indices, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if blocks.block_seq.shape != (blocks.num_blocks,) or blocks.block_start.shape != (blocks.num_blocks,):
        raise ValueError("extend_attention: blocks.block_seq and blocks.block_start must have num_blocks entries")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"extend_attention: block_n must be a power of two >= 16, got {block_n}")
    if num_warps not in (1, 2, 4, 8, 16) or (num_stages is not None and not 1 <= num_stages <= 8):
        raise ValueError(f"extend_attention: num_warps must be a power of two <= 16 and num_stages in 1..8, got "
                         f"{num_warps} and {num_stages}")
    out = check_output("extend_attention", out, q)
    tensors = (q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, out, *blocks[:3])
    check_one_device("extend_attention", tensors)
    if num_tokens == 0 or blocks.num_blocks == 0:
        return out

    qk_scale = (scale if scale is not None else 1.0 / math.sqrt(head_dim)) * LOG2E
    group = num_heads // num_kv_heads
    _extend_kernel[(blocks.num_blocks, num_kv_heads if pack_gqa else num_heads)](
        q, k_cache, v_cache, out, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        blocks.q_start, blocks.block_seq, blocks.block_start, qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        req_to_token.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=blocks.block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_DTYPE=dot_operand_dtype(k_cache.dtype, _extend_kernel),
        DOT_PRECISION=_dot_precision(k_cache.dtype),
        PACK_GQA=pack_gqa,
        ROWS=blocks.block_m * group if pack_gqa else blocks.block_m,
        num_warps=num_warps,
        # float32 tiles take twice the shared memory per pipeline stage.
        num_stages=num_stages if num_stages is not None else 2 if k_cache.dtype == torch.float32 else 3,
    )
    return out
