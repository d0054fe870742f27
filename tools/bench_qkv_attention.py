"""The batch-1 qkv projection and the decode attention's stage 1 in one kernel, against two (GPU).

    python tools/bench_qkv_attention.py [--contexts 640,1152] [--layers 16] [--repeats 20]

Why: at batch 1 the qkv gemv (6.3 µs a layer), then stage 1 (3.8) and stage 2 (2.2) of the decode
attention run one after the other, and stage 1 is a chain of round trips (the length, the
slots, K, V) that starts only when the last qkv program ends. Kernel boundaries and grid
barriers cost about the same (tools/bench_stream_boundary.py), but stage 1 needs only one kv
head's rows of the projection, not all of them: 96 of the gemv's 768 programs (4 q heads, its k
and its v head, 4 rows a program). So the projection's programs can do the attention
themselves: each takes a ticket of its kv head when its rows are stored, and those holding the
last 16 tickets (the last to finish, so no program waits long) become the head's 16 splits:
each reads the length and its slots, waits until all 96 tickets are drawn, then loads q and its
block of K/V and stores its partial for stage 2, as stage 1 would. The chain's first round
trips run under the projection's tail and the kernel launch between them goes.

Rows, µs a layer (16 layers' weights and K/V in one CUDA graph; a gemv of the 1B's qkv shape,
4 rows a program, 8 warps, storing q and the new token's k and v):
- the gemv alone; the gemv, then our decode attention (stage 1 and stage 2, the engine's
  batch-1 launch); the gemv with the splits in it, then stage 2.
The fused kernel spins on its counters: it needs every program resident or finished (the last
16 tickets of a head wait; at most 128 programs spin), so it runs only on a GPU.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.triton_decode import LOG2E, _decode_stage2_kernel, decode_attention  # noqa: E402
from bench_gemv import time_graph  # noqa: E402  (tools/, this script's folder, is on sys.path)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 8, 64  # llama-3.2-1b
GROUP = HEADS // KV_HEADS
ROWS = (HEADS + 2 * KV_HEADS) * HEAD_DIM  # 3,072: q, k and v rows
BLOCK_ROWS = 4
PER_HEAD = (GROUP + 2) * HEAD_DIM // BLOCK_ROWS  # 96 programs make one kv head's rows
SPLITS = 16  # the batch-1 split cap (triton_decode.DEFAULT_MAX_KV_SPLITS)
MIN_SPLIT_LEN = 64
BLOCK_KEYS = 64
# The fused kernel's (prefetch, warps, early) rows.
VARIANTS = [(False, 8, False), (True, 8, False), (True, 4, False), (True, 4, True), (True, 8, True), (False, 4, True)]
# Probes of the fused kernel's cost (timed only; their results are not the attention's):
PROBE_TICKETS = 1  # tickets drawn, no split work (the counters then stay up: reset between calls)
PROBE_NO_WAIT = 2  # the splits run without waiting for the head's rows (wrong values, no sync)
_PROBE_TICKETS = tl.constexpr(PROBE_TICKETS)  # (the kernels' copies: a jit function reads only constexpr globals)
_PROBE_NO_WAIT = tl.constexpr(PROBE_NO_WAIT)


@triton.jit
def _qkv_attend_kernel(x_ptr, w_ptr, q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, seq_len_ptr, slot_ptr,
                       mid_o_ptr, mid_lse_ptr, counter_ptr, qk_scale, min_split_len,
                       K: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
                       NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PER_HEAD: tl.constexpr,
                       SPLITS: tl.constexpr, BLOCK_KEYS: tl.constexpr, ATTEND: tl.constexpr,
                       PREFETCH: tl.constexpr = False, PROBE: tl.constexpr = 0, EARLY: tl.constexpr = False):
    """Rows ``pid * BLOCK_N ...`` of ``w @ x``: q rows into ``q``, the new token's k and v rows
    into the caches at ``slot``. ``ATTEND``: then draw a ticket of the rows' kv head; the last
    SPLITS tickets become that head's splits (see the module docstring): partials into
    ``mid_o [H, SPLITS, D]`` and ``mid_lse [H, SPLITS]``. ``counter`` ``[2 * KVH]`` int32, zero:
    tickets, then splits done; the last split done puts both back to zero."""
    pid = tl.program_id(0)
    cols = tl.arange(0, K)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + cols).to(tl.float32)
    w = tl.load(w_ptr + rows[:, None] * K + cols[None, :]).to(tl.float32)
    y = tl.sum(w * x[None, :], axis=1)
    q_rows: tl.constexpr = NUM_Q_HEADS * HEAD_DIM
    kv_rows: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    first = pid * BLOCK_N
    slot = tl.load(slot_ptr).to(tl.int64)
    if first < q_rows:
        tl.store(q_ptr + rows, y.to(q_ptr.dtype.element_ty))
        kv_head = first // HEAD_DIM // GROUP
    elif first < q_rows + kv_rows:
        tl.store(k_cache_ptr + slot * kv_rows + rows - q_rows, y.to(k_cache_ptr.dtype.element_ty))
        kv_head = (first - q_rows) // HEAD_DIM
    else:
        tl.store(v_cache_ptr + slot * kv_rows + rows - q_rows - kv_rows, y.to(v_cache_ptr.dtype.element_ty))
        kv_head = (first - q_rows - kv_rows) // HEAD_DIM
    if ATTEND:
        tl.debug_barrier()  # every thread's rows stored before the ticket publishes them
        ticket = tl.atomic_add(counter_ptr + kv_head, 1, sem="acq_rel")
        # EARLY: the head's first SPLITS tickets are its splits (they wait longest, their first
        # round trips under the head's remaining rows), else its last (they wait least).
        first_split = 0 if EARLY else PER_HEAD - SPLITS
        if ticket >= first_split and ticket < first_split + SPLITS and PROBE != _PROBE_TICKETS:
            _split_of_head(ticket - first_split, kv_head, q_ptr, k_cache_ptr, v_cache_ptr, table_ptr,
                           seq_len_ptr, mid_o_ptr, mid_lse_ptr, counter_ptr, qk_scale, min_split_len, HEAD_DIM,
                           NUM_KV_HEADS, GROUP, PER_HEAD, SPLITS, BLOCK_KEYS, PREFETCH, PROBE)


@triton.jit
def _prefetch_l2(addresses):
    """``prefetch.global.L2`` of each address (int64): no register holds the line."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addresses], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _split_of_head(split, kv_head, q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, seq_len_ptr, mid_o_ptr, mid_lse_ptr,
                   counter_ptr, qk_scale, min_split_len, HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   GROUP: tl.constexpr, PER_HEAD: tl.constexpr, SPLITS: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                   PREFETCH: tl.constexpr, PROBE: tl.constexpr):
    """Split ``split`` of ``kv_head``'s attention over the sequence's context (the split rule of
    triton_decode: one split per ``min_split_len`` tokens, at most SPLITS), once all PER_HEAD
    tickets of the head are drawn; then counts itself done."""
    seq_len = tl.load(seq_len_ptr).to(tl.int32)
    num_splits = tl.minimum(tl.maximum(tl.cdiv(seq_len, min_split_len), 1), SPLITS)
    split_len = tl.cdiv(seq_len, num_splits)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    keys = tl.arange(0, BLOCK_KEYS)
    slots = tl.load(table_ptr + start + keys, mask=start + keys < end, other=0).to(tl.int64)  # the first block's
    kv_stride: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    if PREFETCH:  # the first block's K and V lines into L2 while the head's last rows are computed
        rows = (slots * kv_stride + kv_head * HEAD_DIM) * 2  # bytes: one 128-byte line a key (bf16, head_dim 64)
        _prefetch_l2(k_cache_ptr.to(tl.int64, bitcast=True) + rows)
        _prefetch_l2(v_cache_ptr.to(tl.int64, bitcast=True) + rows)
    # Polled with plain (volatile) loads, not atomics: the head's last tickets are atomics on
    # the same counter, and 16 pollers' atomics queued ahead of them. One acquiring atomic once
    # the count is complete orders the loads below after the other programs' stores.
    if PROBE != _PROBE_NO_WAIT:
        seen = tl.load(counter_ptr + kv_head, volatile=True)
        while seen < PER_HEAD:
            seen = tl.load(counter_ptr + kv_head, volatile=True)
        tl.atomic_add(counter_ptr + kv_head, 0, sem="acquire")
    h = tl.arange(0, 16)  # the head group padded to a tensor-core tile's 16 rows
    h_mask = h < GROUP
    heads = kv_head * GROUP + h
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + heads[:, None] * HEAD_DIM + dims[None, :], mask=h_mask[:, None], other=0.0,
                cache_modifier=".cg")
    m_i = tl.full((16,), float("-inf"), tl.float32)
    l_i = tl.zeros((16,), tl.float32)
    acc = tl.zeros((16, HEAD_DIM), tl.float32)
    for n0 in range(start, end, BLOCK_KEYS):
        valid = n0 + keys < end
        if n0 > start:
            slots = tl.load(table_ptr + n0 + keys, mask=valid, other=0).to(tl.int64)
        offs = slots[:, None] * kv_stride + kv_head * HEAD_DIM + dims[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0, cache_modifier=".cg")
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0, cache_modifier=".cg")
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if start < end:
        mid = heads * SPLITS + split
        tl.store(mid_o_ptr + mid[:, None] * HEAD_DIM + dims[None, :], acc / l_i[:, None], mask=h_mask[:, None])
        tl.store(mid_lse_ptr + mid, m_i + tl.log2(l_i), mask=h_mask)
    if tl.atomic_add(counter_ptr + NUM_KV_HEADS + kv_head, 1, sem="acq_rel") == SPLITS - 1:
        tl.store(counter_ptr + kv_head, 0)  # every split has seen all tickets: ready for the next launch
        tl.store(counter_ptr + NUM_KV_HEADS + kv_head, 0)


class Layer:
    """One layer's qkv weight, K/V caches (a context of ``context`` tokens in slots 1..context,
    the new token's slot after them) and scratch."""

    def __init__(self, context: int, device: str, gen: torch.Generator) -> None:
        def randn(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(device)
        self.w = randn(ROWS, HIDDEN, scale=HIDDEN ** -0.5)
        slots = context + 2
        self.k_cache = randn(slots, KV_HEADS, HEAD_DIM, scale=1.0)
        self.v_cache = randn(slots, KV_HEADS, HEAD_DIM, scale=1.0)
        self.q = torch.empty(HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        self.out = torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        self.mid_o = torch.empty(HEADS, SPLITS, HEAD_DIM, dtype=torch.float32, device=device)
        self.mid_lse = torch.empty(HEADS, SPLITS, dtype=torch.float32, device=device)
        self.counter = torch.zeros(2 * KV_HEADS, dtype=torch.int32, device=device)


class Step:
    """The shared inputs of ``layers`` layers at one context: x, the slot table (the new token last)."""

    def __init__(self, context: int, layers: int, device: str) -> None:
        gen = torch.Generator().manual_seed(context)
        self.layers = [Layer(context, device, gen) for _ in range(layers)]
        self.x = (torch.randn(HIDDEN, generator=gen)).to(torch.bfloat16).to(device)
        length = context + 1  # the new token's K/V included, as the decode attention reads them
        self.table = torch.arange(1, length + 1, dtype=torch.int32, device=device)[None, :].contiguous()
        self.slot = torch.tensor([length], dtype=torch.int64, device=device)
        self.seq_len = torch.tensor([length], dtype=torch.int64, device=device)
        self.req = torch.zeros(1, dtype=torch.int64, device=device)
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def project(self, layer: Layer, attend: bool, prefetch: bool = False, warps: int = 8, probe: int = 0,
                early: bool = False) -> None:
        _qkv_attend_kernel[(ROWS // BLOCK_ROWS,)](
            self.x, layer.w, layer.q, layer.k_cache, layer.v_cache, self.table, self.seq_len, self.slot,
            layer.mid_o, layer.mid_lse, layer.counter, self.scale * LOG2E, MIN_SPLIT_LEN,
            K=HIDDEN, BLOCK_N=BLOCK_ROWS, HEAD_DIM=HEAD_DIM, NUM_Q_HEADS=HEADS, NUM_KV_HEADS=KV_HEADS, GROUP=GROUP,
            PER_HEAD=PER_HEAD, SPLITS=SPLITS, BLOCK_KEYS=BLOCK_KEYS, ATTEND=attend, PREFETCH=prefetch, PROBE=probe, EARLY=early,
            num_warps=warps)

    def two_kernels(self, layer: Layer) -> None:
        """The gemv, then our decode attention as the engine launches it at batch 1."""
        self.project(layer, attend=False)
        decode_attention(layer.q.view(1, HEADS, HEAD_DIM), layer.k_cache, layer.v_cache, self.table, self.req,
                         self.seq_len, None, max_kv_splits=SPLITS, min_split_len=MIN_SPLIT_LEN, out=layer.out,
                         block_n=BLOCK_KEYS, num_warps=4, prefetch_slots=True)

    def fused(self, layer: Layer, prefetch: bool = False, warps: int = 8, early: bool = False) -> None:
        """The gemv with the splits in it (``prefetch``: their first K/V block into L2 before they
        wait; ``early``: the head's first tickets are the splits), then stage 2."""
        self.project(layer, attend=True, prefetch=prefetch, warps=warps, early=early)
        self.stage2(layer)

    def stage2(self, layer: Layer) -> None:
        """Our stage 2 over the fused kernel's partials."""
        _decode_stage2_kernel[(1, HEADS)](
            layer.mid_o, layer.mid_lse, layer.out, self.seq_len, self.seq_len, MIN_SPLIT_LEN,
            0, layer.mid_o.stride(0), layer.mid_o.stride(1), 0, layer.mid_lse.stride(0),
            layer.out.stride(0), layer.out.stride(1),
            MAX_SPLITS=SPLITS, HEAD_DIM=HEAD_DIM, BLOCK_S=SPLITS, BLOCK_D=HEAD_DIM, SPLITS_FROM_LEN=True,
            TRIGGER=False, num_warps=4)


def check(step: Step, prefetch: bool = False, warps: int = 8, early: bool = False) -> float:
    """The fused path's attention output against the two kernels' on the first layer: max abs difference."""
    layer = step.layers[0]
    step.two_kernels(layer)
    want = layer.out.float().clone()
    layer.out.fill_(float("nan"))
    step.fused(layer, prefetch, warps, early)
    if int(layer.counter.abs().sum()) != 0:
        raise RuntimeError("bench_qkv_attention: the fused kernel left its counters non-zero")
    return float((layer.out.float() - want).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="640,1152")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_qkv_attention: needs a CUDA device (its fused kernel spins on counters); none is available here")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    for context in (int(c) for c in options.contexts.split(",")):
        step = Step(context, options.layers, "cuda")
        diffs = [check(step, *variant) for variant in VARIANTS]
        print(f"context {context}: fused against two kernels, max |diff| {max(diffs):.3g}", flush=True)
        if not max(diffs) < 2e-2:
            raise RuntimeError(f"bench_qkv_attention: the fused attention differs by {max(diffs)}")
        per_layer = 1000.0 / options.layers
        rows = {
            "gemv alone": lambda: [step.project(layer, False) for layer in step.layers],
            "gemv | stage 1 | stage 2": lambda: [step.two_kernels(layer) for layer in step.layers],
            **{f"gemv + {'first' if early else 'last'} splits{' (K/V prefetched)' if prefetch else ''}, {warps} warps "
               "| stage 2": (lambda variant=(prefetch, warps, early): [step.fused(layer, *variant) for layer in step.layers])
               for prefetch, warps, early in VARIANTS},
        }
        rows["gemv alone, 4 warps"] = lambda: [step.project(layer, False, warps=4) for layer in step.layers]
        rows["probe: tickets only, 4 warps"] = lambda: [
            (layer.counter.zero_(), step.project(layer, True, True, 4, PROBE_TICKETS)) for layer in step.layers]
        rows["probe: splits without the wait, 4 warps | stage 2"] = lambda: [
            (step.project(layer, True, True, 4, PROBE_NO_WAIT), step.stage2(layer)) for layer in step.layers]
        rows["probe: the zeroing alone"] = lambda: [layer.counter.zero_() for layer in step.layers]
        for label, calls in rows.items():
            print(f"  {label:<48} {time_graph(calls, options.repeats) * per_layer:7.2f} us a layer", flush=True)


if __name__ == "__main__":
    main()
