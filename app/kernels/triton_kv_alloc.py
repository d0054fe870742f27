"""The KV slot allocator's pop in one kernel (app/engine/kv_pool.py, SlotAllocator.alloc).

A step's new slots come off the allocator's device stack of free pages, last pushed first, and
their pages are marked taken. Through torch that is two or three small kernels a step (the
popped pages copied out, the taken marks, with pages of several slots their expansion into slot
ids), each ~1 us of device time plus a launch gap of 1-3 us on the H200, before every decode
step (in the H200's batch-1 trace ~19 us between two replays); here it is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

POP_BLOCK = 1024  # pages a program


# Not specialised on the stack's top or the count: one compiled kernel per page size serves
# every step, so that none compiles while the server serves.
@triton.jit(do_not_specialize=["top", "n"])
def _pop_pages_kernel(
    stack_ptr,  # int64 [pages]: free page ids in [0, top), the last pushed at top - 1
    page_free_ptr,  # bool [pages]: set False for each popped page
    slots_out_ptr,  # int64 [n * PAGE]: slot ids, page after page
    top,
    n,
    PAGE: tl.constexpr,  # slots a page
    PAGE_P2: tl.constexpr,  # next power of two >= PAGE
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # the i-th page popped
    popped = i < n
    page = tl.load(stack_ptr + (top - 1 - i), mask=popped, other=0)
    tl.store(page_free_ptr + page, tl.zeros((BLOCK,), dtype=tl.int1), mask=popped)
    if PAGE == 1:
        tl.store(slots_out_ptr + i, page, mask=popped)
    else:
        offsets = tl.arange(0, PAGE_P2)
        slots = page[:, None] * PAGE + offsets[None, :]
        in_page = (offsets < PAGE)[None, :]
        tl.store(slots_out_ptr + i[:, None] * PAGE + offsets[None, :], slots, mask=popped[:, None] & in_page)


def pop_pages(stack: torch.Tensor, page_free: torch.Tensor, top: int, n: int, page_size: int) -> torch.Tensor:
    """The slots of pages ``stack[top - 1], stack[top - 2], ..., stack[top - n]`` (int64, each
    page's slots in order), with ``page_free`` set False at those pages. The caller moves its
    top down by ``n``. Raises ValueError on tensors that do not fit."""
    if (stack.dim() != 1 or stack.dtype != torch.int64 or page_free.dtype != torch.bool or page_free.dim() != 1
            or stack.device != page_free.device or not 0 < n <= top <= stack.shape[0] or page_size < 1):
        raise ValueError(f"pop_pages: need an int64 stack and a bool page_free on one device and 0 < n <= top <= "
                         f"{stack.shape[0]}, page_size >= 1; got {stack.dtype} {page_free.dtype}, n {n}, top {top}, "
                         f"page_size {page_size}")
    out = torch.empty(n * page_size, dtype=torch.int64, device=stack.device)
    _pop_pages_kernel[(triton.cdiv(n, POP_BLOCK),)](
        stack, page_free, out, top, n, PAGE=page_size, PAGE_P2=triton.next_power_of_2(page_size), BLOCK=POP_BLOCK,
        num_warps=4,
    )
    return out
