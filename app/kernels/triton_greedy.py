"""Greedy decoding in fewer kernels: the argmax inside the output projection, and a step's
bookkeeping in one kernel (``fused-greedy``).

Why: after a batch-1 decode step's graph, torch's greedy path launched ~9 small kernels (argmax,
which reduces a 128k row in one block for ~27 us, then the step counter, the stop test as eq/and/
any, the length test, two casts and a stack for the copy to the host), each ~2 us plus a gap,
~5 % of a 1 ms step. Here:

* **Argmax keys.** Each program of the lm_head gemv (one row of x) reduces the logits it stores
  to one int64 *key* and folds it into one of ``ARGMAX_SLOTS`` slots with ``atomic_max``::

      key = ordered(value) << INDEX_BITS | (INDEX_MASK - index)        (0: an empty slot)

  ``ordered`` maps a float32's bits to an unsigned 32-bit integer of the same order, so the
  largest key holds the largest logit, and of equal logits the smallest index (torch.argmax's
  choice). The value is the logit as stored (rounded to the model dtype), so the pick equals
  ``argmax`` of the returned logits exactly. Slots spread the atomics (a program writes slot
  ``pid % ARGMAX_SLOTS``); the consumer reduces ``ARGMAX_SLOTS`` keys, not 128k logits, and
  clears them for the next step. NaN logits are not ordered (torch would pick them).
* **The record kernel** (:func:`greedy_record`): per row, the token (from the keys), the step
  counter advanced, the stop-token test and the length test, written as one ``[3, B]`` int64
  tensor (tokens, stopped, capped) that goes to the host in one copy.

Above batch 1 the output projection is cuBLAS's: :func:`argmax_keys_of` folds its logits into
keys the same way, many programs a row. ``argmax_from_keys`` is the torch reading of the keys
(tests, and any caller off the fast path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ARGMAX_SLOTS = 64  # keys per row: 32k lm_head programs fold into 64 addresses (~500 atomics each)
INDEX_BITS = 20  # vocabularies up to 2^20 = 1,048,576 tokens
INDEX_MASK = (1 << INDEX_BITS) - 1
MAX_VOCAB = 1 << INDEX_BITS
ARGMAX_BLOCK = 4096  # logits per program of argmax_keys_of (8 KB of bf16)


@triton.jit
def argmax_key(values, index, valid):
    """The largest key of a block of float32 ``values`` at vocabulary ``index`` where ``valid``
    (0 when none is): see the module docstring."""
    bits = values.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    ordered = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    keys = (ordered << 20) | (0xFFFFF - index.to(tl.int64))
    return tl.max(tl.where(valid, keys, 0), axis=0)


# Not specialised on the batch size or the stop-id count (triton would compile a kernel for 1, for
# multiples of 16 and for the rest): the warm-up request's compile serves every later step.
@triton.jit(do_not_specialize=["B", "S"])
def _greedy_record_kernel(keys_ptr, stop_ptr, has_stop_ptr, generated_ptr, max_new_ptr, packed_ptr,
                          B, S, SLOTS: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    slots = row * SLOTS + tl.arange(0, SLOTS)
    best = tl.max(tl.load(keys_ptr + slots), axis=0)
    token = 0xFFFFF - (best & 0xFFFFF)
    tl.store(keys_ptr + slots, tl.zeros((SLOTS,), dtype=tl.int64))  # empty for the next step
    generated = tl.load(generated_ptr + row) + 1
    tl.store(generated_ptr + row, generated)
    cols = tl.arange(0, BLOCK_S)
    stops = tl.load(stop_ptr + row * S + cols, mask=cols < S, other=-1)
    hit = tl.max((stops == token).to(tl.int64), axis=0) * tl.load(has_stop_ptr + row).to(tl.int64)
    capped = (generated >= tl.load(max_new_ptr + row)).to(tl.int64)
    tl.store(packed_ptr + row, token)
    tl.store(packed_ptr + B + row, hit)
    tl.store(packed_ptr + 2 * B + row, capped)


@triton.jit
def _argmax_rows_kernel(logits_ptr, keys_ptr, V, stride_b, BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = cols < V
    values = tl.load(logits_ptr + row.to(tl.int64) * stride_b + cols, mask=valid, other=float("-inf")).to(tl.float32)
    tl.atomic_max(keys_ptr + row * SLOTS + chunk % SLOTS, argmax_key(values, cols, valid))


def argmax_keys_of(logits: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
    """The argmax of each row of ``logits`` ``[B, V]`` folded into argmax keys ``[B, ARGMAX_SLOTS]``
    (``keys``, empty, or a fresh buffer), for :func:`greedy_record`: the rows are read once by
    ARGMAX_BLOCK-wide programs in parallel, where torch's argmax reduces each row in one block
    (at 256 rows of a 128k vocabulary, 49 us a step on the H200 for 65 MB of bf16). Raises
    ValueError on shapes the keys cannot index."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"argmax_keys_of: logits must be float [B, V] with a unit stride along V, got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    rows, vocab = logits.shape
    if vocab > MAX_VOCAB:
        raise ValueError(f"argmax_keys_of: keys index at most {MAX_VOCAB} columns, got {vocab}")
    if keys is None:
        keys = empty_argmax_keys(rows, logits.device)
    elif keys.shape != (rows, ARGMAX_SLOTS) or keys.dtype != torch.int64 or not keys.is_contiguous():
        raise ValueError(f"argmax_keys_of: keys must be contiguous [{rows}, {ARGMAX_SLOTS}] int64, got "
                         f"{tuple(keys.shape)} {keys.dtype}")
    if rows and vocab:
        _argmax_rows_kernel[(rows, triton.cdiv(vocab, ARGMAX_BLOCK))](
            logits, keys, vocab, logits.stride(0), BLOCK=ARGMAX_BLOCK, SLOTS=ARGMAX_SLOTS)
    return keys


def argmax_from_keys(keys: torch.Tensor) -> torch.Tensor:
    """The ``[B]`` int64 tokens that argmax keys ``[B, slots]`` hold (torch; leaves them as they are)."""
    return INDEX_MASK - (keys.amax(dim=-1) & INDEX_MASK)


def empty_argmax_keys(rows: int, device: torch.device | str) -> torch.Tensor:
    """A ``[rows, ARGMAX_SLOTS]`` key buffer, empty (what the gemv folds into and the record clears)."""
    return torch.zeros((rows, ARGMAX_SLOTS), dtype=torch.int64, device=device)


def greedy_record(
    *,
    argmax_keys: torch.Tensor,
    stop_ids: torch.Tensor,
    has_stop: torch.Tensor,
    num_generated: torch.Tensor,
    max_new_tokens: torch.Tensor,
) -> torch.Tensor:
    """One greedy step's bookkeeping for ``B`` rows in one kernel; returns ``[3, B]`` int64 rows
    (tokens, stopped 0/1, length-capped 0/1). The tokens come from ``argmax_keys`` ``[B,
    ARGMAX_SLOTS]`` (folded by the lm_head gemv or :func:`argmax_keys_of`; it clears them);
    ``num_generated`` ``[B]`` int64 is advanced by one in place; a row stops when ``has_stop``
    and its token is in ``stop_ids`` ``[B, S]`` int64; it is capped when its count reaches
    ``max_new_tokens``. Raises ValueError on shapes that do not match."""
    b = num_generated.shape[0]
    if argmax_keys.shape != (b, ARGMAX_SLOTS) or argmax_keys.dtype != torch.int64 or not argmax_keys.is_contiguous():
        raise ValueError(f"greedy_record: argmax_keys must be [{b}, {ARGMAX_SLOTS}] int64, got "
                         f"{tuple(argmax_keys.shape)} {argmax_keys.dtype}")
    if stop_ids.dim() != 2 or stop_ids.shape[0] != b or has_stop.shape != (b,) or max_new_tokens.shape != (b,):
        raise ValueError(f"greedy_record: per-row tensors of {b} rows expected, got stop_ids {tuple(stop_ids.shape)}, "
                         f"has_stop {tuple(has_stop.shape)}, max_new_tokens {tuple(max_new_tokens.shape)}")
    if num_generated.dtype != torch.int64 or not num_generated.is_contiguous():
        raise ValueError("greedy_record: num_generated must be contiguous int64 (it is advanced in place)")
    stop_ids = stop_ids.contiguous()
    s = stop_ids.shape[1]
    packed = torch.empty((3, b), dtype=torch.int64, device=num_generated.device)
    if b == 0:
        return packed
    _greedy_record_kernel[(b,)](
        argmax_keys, stop_ids, has_stop, num_generated, max_new_tokens.contiguous(), packed, b, s,
        SLOTS=ARGMAX_SLOTS, BLOCK_S=triton.next_power_of_2(max(s, 1)),
    )
    return packed
