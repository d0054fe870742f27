"""Swapping a preempted request's KV to host memory and back (--enable-kv-swap).

When decode runs out of KV (or a more important request preempts one), the victim's KV, every
layer's K and V at the slots of its first ``kv_len`` tokens, is copied into host memory (pinned
on CUDA, so the copy back is a plain DMA) before its device slots are given back. When it is
admitted again, slots are allocated for the positions the prefix cache does not already hold,
the copy goes back there, and only its last token is computed (its logits give the next token),
instead of its whole prompt and output.

What is copied: all of the request's tokens, its cached prefix too. That part stays in the
prefix cache when the request leaves (``KVMemory.release``), but it is evictable from then on,
so the copy is what guarantees it comes back; on resumption only the positions past what the
cache still matches are written.

The host pool is a budget of tokens (``capacity``); each swapped request holds a buffer of its
own ``[num_layers, kv_len, num_kv_heads, head_dim]`` for K and one for V until it resumes or
ends. A request whose KV does not fit the budget is recomputed as without swap
(``fallbacks``). Copies happen only on retraction and resumption, never per decode step. The
copy out waits for the device (a retraction happens with no step in flight); the copy back is
queued on the stream from pinned memory without waiting, since admission may be scheduled
while a step is in flight (the overlap schedule), and the stream orders it before the prefill
that reads it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from app.engine.memory import KVMemory
from app.engine.request import Request


class SwappedKV(NamedTuple):
    """One request's KV in host memory: positions ``[0, length)`` of every layer."""

    k: torch.Tensor  # [num_layers, length, num_kv_heads, head_dim]
    v: torch.Tensor
    length: int


class HostKVSwap:
    """The host-memory pool of swapped-out requests' KV, by request id, within ``capacity`` tokens."""

    def __init__(self, memory: KVMemory, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"--host-kv-pool-tokens must be at least 1, got {capacity}")
        self.memory = memory
        self.capacity = capacity
        self._swapped: dict[str, SwappedKV] = {}
        self.used = 0  # tokens held in host memory now
        self.swapped_out = 0  # requests whose KV was copied to the host
        self.swapped_in = 0  # requests that resumed from their host copy
        self.fallbacks = 0  # victims recomputed instead: their KV did not fit the host pool or the device

    def __len__(self) -> int:
        return len(self._swapped)

    def figures(self) -> dict[str, int]:
        """The host pool's size and use, and the counts, for /server_info."""
        return {"capacity_tokens": self.capacity, "used_tokens": self.used, "requests": len(self._swapped),
                "swapped_out": self.swapped_out, "swapped_in": self.swapped_in, "fallbacks": self.fallbacks}

    def holds(self, req: Request) -> bool:
        return req.rid in self._swapped

    def swap_out(self, req: Request) -> bool:
        """Copy ``req``'s KV to host memory (call before its slots are released); False, copying
        nothing, when it has none or the pool cannot hold it (it is then recomputed)."""
        n = req.kv_len
        if req.row is None or n == 0:
            return False
        if self.used + n > self.capacity:
            self.fallbacks += 1
            return False
        pool = self.memory.pool
        slots = self.memory.table.slots(req.row, 0, n).to(pool.device)
        shape = (pool.num_layers, n, *pool.k[0].shape[1:])
        pinned = pool.device.type == "cuda"
        k = torch.empty(shape, dtype=pool.dtype, pin_memory=pinned)
        v = torch.empty(shape, dtype=pool.dtype, pin_memory=pinned)
        for layer in range(pool.num_layers):
            k[layer].copy_(pool.k[layer].index_select(0, slots))
            v[layer].copy_(pool.v[layer].index_select(0, slots))
        self._swapped[req.rid] = SwappedKV(k, v, n)
        self.used += n
        self.swapped_out += 1
        return True

    def swap_in(self, req: Request) -> int:
        """Bring back ``req``'s host copy just after admission (``KVMemory.admit`` gave it its
        cached prefix): slots for the positions past that prefix, the KV copied there, ``kv_len``
        moved to the copy's end. The slots allocated (0 when the prefix cache still held it all);
        -1, changing nothing, when it has no copy or the pool cannot give the slots. The copy is
        kept until :meth:`resumed` (the step may still not take the request)."""
        saved = self._swapped.get(req.rid)
        if saved is None or req.row is None:
            return -1
        start, end = req.kv_len, saved.length
        if start >= end:
            return 0
        memory = self.memory
        slots = memory.alloc_for([req], [end - start])
        if slots is None:
            return -1
        taken = memory.slots_needed([req], [end - start])
        memory.table.req_to_token[req.row, start:end] = slots.to(memory.table.device, torch.int32)
        pool = memory.pool
        at = slots.to(pool.device)
        queued = pool.device.type == "cuda"  # from pinned memory: torch keeps it until the copy is done
        for layer in range(pool.num_layers):
            pool.k[layer][at] = saved.k[layer, start:end].to(pool.device, non_blocking=queued)
            pool.v[layer][at] = saved.v[layer, start:end].to(pool.device, non_blocking=queued)
        req.kv_len = end
        return taken

    def resumed(self, req: Request) -> None:
        """``req`` was admitted with its KV back: its host copy is freed."""
        if self._drop(req):
            self.swapped_in += 1

    def recomputed(self, req: Request) -> None:
        """``req`` was admitted without its copy (the device pool could not take it back): it is
        recomputed and its host copy freed."""
        if self._drop(req):
            self.fallbacks += 1

    def discard(self, req: Request) -> None:
        """``req`` ended (or will be recomputed): free its host copy, if any."""
        self._drop(req)

    def _drop(self, req: Request) -> bool:
        saved = self._swapped.pop(req.rid, None)
        if saved is None:
            return False
        self.used -= saved.length
        return True
