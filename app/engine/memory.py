"""KV memory for requests: slots, the request table and the prefix cache, used together.

Every KV slot is in exactly one of three states, each counted from its own structure:

- free: on the allocator's free list;
- evictable: held only by the radix tree (no running request has it locked);
- used: held by live requests, either as their own slots (request table rows) or as tree
  nodes they have locked.

``usage()`` computes the three independently, so a leak or a double count shows up as a sum
that is not the capacity (tests check it after every scenario).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

from app.engine.kv_pool import KVPool, ReqToTokenPool, SlotAllocator
from app.engine.radix_cache import RadixCache
from app.engine.request import Request


class PoolUsage(NamedTuple):
    total: int
    free: int
    used: int  # held by live requests (their own slots + tree nodes they lock)
    evictable: int  # held only by the prefix cache
    locked: int  # the part of ``used`` that lives in the tree

    @property
    def consistent(self) -> bool:
        return self.free + self.used + self.evictable == self.total


class KVMemory:
    """Owns the allocator, the KV buffers, the request table and the prefix cache."""

    def __init__(self, allocator: SlotAllocator, pool: KVPool, table: ReqToTokenPool, cache: RadixCache) -> None:
        self.allocator = allocator
        self.pool = pool
        self.table = table
        self.cache = cache

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def available(self) -> int:
        """Slots a request could get now: free, plus what eviction can give back."""
        return self.allocator.num_free() + self.cache.evictable_size()

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` slots, evicting least recently used cache leaves if needed; None if impossible."""
        slots = self.allocator.alloc(n)
        if slots is None:
            shortfall = n - self.allocator.num_free()
            if shortfall > self.cache.evictable_size():
                return None
            self.cache.evict(shortfall)
            slots = self.allocator.alloc(n)
        return slots

    # ------------------------------------------------------------ admission and release

    def admit(self, req: Request) -> bool:
        """Give ``req`` a table row and the longest cached prefix of its tokens (locked).

        At least one token is left to compute (its logits give the next token). Returns False,
        changing nothing, when no table row is free.
        """
        rows = self.table.alloc(1)
        if rows is None:
            return False
        fill = req.fill_ids
        match = self.cache.match_prefix(fill[:-1])
        self.cache.lock(match.node)
        req.row, req.node, req.kv_len = rows[0], match.node, match.num_tokens
        if match.num_tokens:
            self.table.req_to_token[req.row, : match.num_tokens] = match.slots.to(torch.int32)
        return True

    def cache_progress(self, req: Request) -> None:
        """Hand the KV computed so far (a chunked prefill) to the tree and re-lock the longer
        prefix, so that other requests can share it and it is never computed twice."""
        row, kv_len = req.row, req.kv_len
        assert row is not None and req.node is not None
        slots = self.table.slots(row, 0, kv_len)
        result = self.cache.insert(req.fill_ids[:kv_len], slots, held=req.node)
        if result.num_tokens:
            self.table.req_to_token[row, : result.num_tokens] = result.slots.to(torch.int32)
        self.cache.lock(result.node)
        self.cache.unlock(req.node)
        req.node = result.node

    def release(self, req: Request) -> None:
        """End ``req``'s hold on memory: its computed KV goes to the prefix cache (or is freed
        when the cache is disabled), its lock and row are given back."""
        if req.row is None:
            return
        assert req.node is not None
        row, kv_len = req.row, req.kv_len
        slots = self.table.slots(row, 0, kv_len)
        result = self.cache.insert(req.fill_ids[:kv_len], slots, held=req.node)
        self.cache.unlock(req.node)
        self.allocator.free(slots[result.num_tokens :])  # the tree took (or freed) the rest
        self.table.free(row)
        req.row, req.node, req.kv_len = None, None, 0

    def flush_cache(self) -> bool:
        """Drop every evictable prefix; False (nothing done) while a request holds a lock."""
        if self.cache.locked_size():
            return False
        self.cache.reset()
        return True

    # ------------------------------------------------------------ accounting

    def usage(self, live: Iterable[Request]) -> PoolUsage:
        """The three disjoint states of every slot, each from its own structure."""
        own = sum(r.kv_len - r.node.depth for r in live if r.row is not None and r.node is not None)
        locked = self.cache.locked_size()
        return PoolUsage(
            total=self.capacity,
            free=self.allocator.num_free(),
            used=own + locked,
            evictable=self.cache.evictable_size(),
            locked=locked,
        )
