"""A decode graph's device-side inputs in one kernel, launched before each replay.

Before a CUDA graph of size ``bs`` replays a step of ``b`` sequences, three things happen on the
device besides the one host-to-device copy of the per-sequence columns (cuda_graph.py):

  the sampled ids (still on the device when the step was queued ahead) -> static input_ids[:b]
  the step's new slots (popped from the allocator's device stack)      -> static out_cache_loc[:b]
                                                          padding rows -> out_cache_loc[b:bs] = dummy slot
  req_to_token[row_i, position_i] = slot_i for the real rows (int32)

Through torch those are four to five small kernels (two copies, a fill, a cast and an indexed
store), each ~2-3 us of device time with its launch gap at batch 1, where a whole step takes
~0.9 ms; here they are one program. The request table is written for real rows only: a padded
row must never touch a live row.

A step of the same sequences as the step before, each one token further (every steady decode
step), needs no host copy at all (``advance``): the kernel moves each real row's position and
length on by one in place, and only the sampled ids, slots and table entries change: one copy
and its gap fewer before the kernel (in the H200's batch-1 trace ~2.5 us a step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from app.kernels.graph_input_layout import DUMMY_SLOT, INPUT_IDS, POSITIONS, REQ_POOL_INDICES, SEQ_LENS


# Not specialised on the batch sizes or the ids' and slots' addresses: one compiled kernel (per
# HAS_IDS) serves every step, so that none compiles while the server serves (see cuda_graph.py's
# warm_up_fill).
@triton.jit(do_not_specialize=["ids_ptr", "slots_ptr", "b", "bs"])
def _load_graph_inputs_kernel(
    per_seq_ptr,  # [4, width] int64: the static columns (rows and positions already copied in)
    width,
    ids_ptr,  # [b] sampled ids on the device (HAS_IDS)
    slots_ptr,  # [b] the step's new slots
    out_cache_loc_ptr,  # [width] int64, static
    table_ptr,  # [rows, max_context_len] int32
    table_stride,
    b,
    bs,
    HAS_IDS: tl.constexpr,
    ADVANCE: tl.constexpr,  # the real rows' positions and lengths move on by one in place
    ROW_IDS: tl.constexpr,
    ROW_POOL: tl.constexpr,
    ROW_POS: tl.constexpr,
    ROW_LENS: tl.constexpr,
    DUMMY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    real = offs < b
    padded = (offs >= b) & (offs < bs)
    if HAS_IDS:
        ids = tl.load(ids_ptr + offs, mask=real, other=0).to(tl.int64)
        tl.store(per_seq_ptr + ROW_IDS * width + offs, ids, mask=real)
    slots = tl.load(slots_ptr + offs, mask=real, other=DUMMY).to(tl.int64)
    tl.store(out_cache_loc_ptr + offs, tl.where(real, slots, DUMMY), mask=real | padded)
    rows = tl.load(per_seq_ptr + ROW_POOL * width + offs, mask=real, other=0)
    positions = tl.load(per_seq_ptr + ROW_POS * width + offs, mask=real, other=0)
    if ADVANCE:
        positions += 1
        tl.store(per_seq_ptr + ROW_POS * width + offs, positions, mask=real)
        lens = tl.load(per_seq_ptr + ROW_LENS * width + offs, mask=real, other=0)
        tl.store(per_seq_ptr + ROW_LENS * width + offs, lens + 1, mask=real)
    tl.store(table_ptr + rows * table_stride + positions, slots.to(tl.int32), mask=real)


def load_graph_inputs(per_seq: torch.Tensor, ids: torch.Tensor | None, slots: torch.Tensor,
                      out_cache_loc: torch.Tensor, req_to_token: torch.Tensor, bs: int, advance: bool = False) -> None:
    """Fill a graph's static inputs for ``b = len(slots)`` real sequences replayed as ``bs``:
    ``ids`` (device, int32 or int64; None when the host already wrote them into ``per_seq``)
    into the input_ids row, ``slots`` into ``out_cache_loc[:b]`` and the dummy slot into
    ``out_cache_loc[b:bs]``, and ``req_to_token[row, position] = slot`` for the real rows, whose
    rows and positions ``per_seq`` already holds, or (``advance``, with ``ids``) held for the step
    before: their positions and lengths move on by one first. Raises ValueError on mismatched
    shapes."""
    b = slots.shape[0]
    width = per_seq.shape[1]
    if (per_seq.dim() != 2 or per_seq.shape[0] < 4 or per_seq.dtype != torch.int64 or not per_seq.is_contiguous()
            or out_cache_loc.shape != (width,) or out_cache_loc.dtype != torch.int64 or not 0 < b <= bs <= width
            or slots.dim() != 1 or (ids is not None and ids.shape != (b,)) or req_to_token.dtype != torch.int32
            or req_to_token.stride(1) != 1 or (advance and ids is None)):
        raise ValueError(
            f"load_graph_inputs: need per_seq [4, W] int64, out_cache_loc [W] int64, 0 < b <= bs <= W slots "
            f"(and ids of b), an int32 row-major table; got per_seq {tuple(per_seq.shape)} {per_seq.dtype}, "
            f"out_cache_loc {tuple(out_cache_loc.shape)} {out_cache_loc.dtype}, {b} slots, bs {bs}, "
            f"ids {None if ids is None else tuple(ids.shape)}, table {req_to_token.dtype} (advance: ids on the device)")
    _load_graph_inputs_kernel[(1,)](
        per_seq, width, ids if ids is not None else slots, slots, out_cache_loc, req_to_token,
        req_to_token.stride(0), b, bs,
        HAS_IDS=ids is not None, ADVANCE=advance, ROW_IDS=INPUT_IDS, ROW_POOL=REQ_POOL_INDICES, ROW_POS=POSITIONS,
        ROW_LENS=SEQ_LENS, DUMMY=DUMMY_SLOT, BLOCK=triton.next_power_of_2(width), num_warps=4,
    )
