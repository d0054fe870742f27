"""A decode graph's device-side inputs in one kernel, launched before each replay.

Before a CUDA graph of size ``bs`` replays a step of ``b`` sequences, its inputs go into the
graph's static buffers (cuda_graph.py):

  the host's per-sequence columns (ids, rows, positions, lengths)      -> static per_seq[4, width]
  the sampled ids (still on the device when the step was queued ahead) -> static input_ids[:b]
  the step's new slots (popped from the allocator's device stack)      -> static out_cache_loc[:b]
                                                          padding rows -> out_cache_loc[b:bs] = dummy slot
  req_to_token[row_i, position_i] = slot_i for the real rows (int32)

Through torch those are a host-to-device copy and four to five small kernels (two copies, a
fill, a cast and an indexed store), each ~2-3 us of device time with its launch gap at batch 1,
where a whole step takes ~0.9 ms; here they are one program. The host columns are read straight
from pinned host memory (mapped into the device's address space): a copy engine's transfer of
those 4 x width words cost ~9 us of the step's timeline on the H200 (11-30), far more than the
program's own reads across the bus. The request table is written for real rows only: a padded
row must never touch a live row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from app.engine.cuda_graph import DUMMY_SLOT, INPUT_IDS, POSITIONS, REQ_POOL_INDICES, SEQ_LENS


# Not specialised on the batch sizes or the ids' and slots' addresses: one compiled kernel (per
# HAS_IDS) serves every step, so that none compiles while the server serves (see cuda_graph.py's
# warm_up_fill).
@triton.jit(do_not_specialize=["host_ptr", "ids_ptr", "slots_ptr", "b", "bs"])
def _load_graph_inputs_kernel(
    host_ptr,  # [4, width] int64: the step's columns, in memory the device reads (pinned host memory)
    per_seq_ptr,  # [4, width] int64: the static columns
    width,
    ids_ptr,  # [b] sampled ids on the device (HAS_IDS)
    slots_ptr,  # [b] the step's new slots
    out_cache_loc_ptr,  # [width] int64, static
    table_ptr,  # [rows, max_context_len] int32
    table_stride,
    b,
    bs,
    HAS_IDS: tl.constexpr,
    ROW_IDS: tl.constexpr,
    ROW_POOL: tl.constexpr,
    ROW_POS: tl.constexpr,
    ROW_LEN: tl.constexpr,
    DUMMY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    columns = offs < width
    real = offs < b
    padded = (offs >= b) & (offs < bs)
    # The four host rows, each stored as read (the ids row with the device's ids over its real
    # columns); rows and positions are then used from registers, not re-read.
    ids = tl.load(host_ptr + ROW_IDS * width + offs, mask=columns, other=0)
    if HAS_IDS:
        ids = tl.where(real, tl.load(ids_ptr + offs, mask=real, other=0).to(tl.int64), ids)
    tl.store(per_seq_ptr + ROW_IDS * width + offs, ids, mask=columns)
    rows = tl.load(host_ptr + ROW_POOL * width + offs, mask=columns, other=0)
    tl.store(per_seq_ptr + ROW_POOL * width + offs, rows, mask=columns)
    positions = tl.load(host_ptr + ROW_POS * width + offs, mask=columns, other=0)
    tl.store(per_seq_ptr + ROW_POS * width + offs, positions, mask=columns)
    lengths = tl.load(host_ptr + ROW_LEN * width + offs, mask=columns, other=0)
    tl.store(per_seq_ptr + ROW_LEN * width + offs, lengths, mask=columns)
    slots = tl.load(slots_ptr + offs, mask=real, other=DUMMY).to(tl.int64)
    tl.store(out_cache_loc_ptr + offs, tl.where(real, slots, DUMMY), mask=real | padded)
    tl.store(table_ptr + rows * table_stride + positions, slots.to(tl.int32), mask=real)


def load_graph_inputs(host: torch.Tensor, per_seq: torch.Tensor, ids: torch.Tensor | None, slots: torch.Tensor,
                      out_cache_loc: torch.Tensor, req_to_token: torch.Tensor, bs: int) -> None:
    """Fill a graph's static inputs for ``b = len(slots)`` real sequences replayed as ``bs``:
    ``host`` (``per_seq``'s shape, in memory the device can read: pinned host memory with CUDA)
    into ``per_seq``, with ``ids`` (device, int32 or int64; None when the host columns hold
    them) over the input_ids row's real columns, ``slots`` into ``out_cache_loc[:b]`` and the
    dummy slot into ``out_cache_loc[b:bs]``, and ``req_to_token[row, position] = slot`` for the
    real rows. ``host`` must stay unchanged until the kernel has run (the caller's ring of
    buffers sees to that). Raises ValueError on mismatched shapes."""
    b = slots.shape[0]
    width = per_seq.shape[1]
    if (host.shape != per_seq.shape or host.dtype != torch.int64 or not host.is_contiguous()
            or (host.device.type == "cpu" and per_seq.is_cuda and not host.is_pinned())
            or per_seq.dim() != 2 or per_seq.shape[0] != 4 or per_seq.dtype != torch.int64 or not per_seq.is_contiguous()
            or out_cache_loc.shape != (width,) or out_cache_loc.dtype != torch.int64 or not 0 < b <= bs <= width
            or slots.dim() != 1 or (ids is not None and ids.shape != (b,)) or req_to_token.dtype != torch.int32
            or req_to_token.stride(1) != 1):
        raise ValueError(
            f"load_graph_inputs: need host columns (pinned with CUDA) and per_seq [4, W] int64, out_cache_loc [W] "
            f"int64, 0 < b <= bs <= W slots (and ids of b), an int32 row-major table; got host "
            f"{tuple(host.shape)} {host.dtype} on {host.device}, per_seq {tuple(per_seq.shape)} {per_seq.dtype}, "
            f"out_cache_loc {tuple(out_cache_loc.shape)} {out_cache_loc.dtype}, {b} slots, bs {bs}, "
            f"ids {None if ids is None else tuple(ids.shape)}, table {req_to_token.dtype}")
    _load_graph_inputs_kernel[(1,)](
        host, per_seq, width, ids if ids is not None else slots, slots, out_cache_loc, req_to_token,
        req_to_token.stride(0), b, bs,
        HAS_IDS=ids is not None, ROW_IDS=INPUT_IDS, ROW_POOL=REQ_POOL_INDICES, ROW_POS=POSITIONS,
        ROW_LEN=SEQ_LENS, DUMMY=DUMMY_SLOT, BLOCK=triton.next_power_of_2(width), num_warps=4,
    )
