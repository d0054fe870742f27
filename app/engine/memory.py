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

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from app.engine.host_to_device import tensor_on
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

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def slots_needed(self, reqs: Sequence[Request], extend_lens: Sequence[int]) -> int:
        """Slots to allocate for extending each request by its extend_len: what does not fit
        in the unused tail of its last page, in whole pages."""
        page = self.page_size
        if page == 1:
            return sum(extend_lens)
        pages = 0
        for req, n in zip(reqs, extend_lens):
            beyond = n - (-req.kv_len) % page  # tokens past the last page's free tail
            if beyond > 0:
                pages += -(-beyond // page)
        return pages * page

    def alloc_for(self, reqs: Sequence[Request], extend_lens: Sequence[int]) -> torch.Tensor | None:
        """The slot of every new token of a step, request after request (the ForwardBatch
        layout), or None when even eviction cannot make room (nothing allocated then).

        With pages of several slots, a request first fills the unused tail of its last page
        (the slots after its last token's), then takes whole new pages::

            page_size 4, kv_len 6, extend 5:
              its pages   [ 8  9 10 11 ][20 21 22 23]        positions 0..5 at 8..11, 20, 21
              new tokens            22 23 | fresh page 36 37 38 39 → 22 23 36 37 38
        """
        page = self.page_size
        if page == 1:
            return self.alloc(sum(extend_lens))
        fresh = self.alloc(self.slots_needed(reqs, extend_lens))
        if fresh is None:
            return None
        device = self.table.device
        in_tail = [min(n, (-r.kv_len) % page) for r, n in zip(reqs, extend_lens)]
        continuing = [i for i, t in enumerate(in_tail) if t]
        last_slots = None
        if continuing:  # one gather: the slot of each continuing request's last token
            rows = tensor_on([reqs[i].row for i in continuing], torch.int64, device)
            ends = tensor_on([reqs[i].kv_len - 1 for i in continuing], torch.int64, device)
            last_slots = self.table.req_to_token[rows, ends].to(torch.int64)
        if all(n == 1 for n in extend_lens):  # decode: vectorised, one slot each
            out = torch.empty(len(reqs), dtype=torch.int64, device=fresh.device)
            starts = [i for i, t in enumerate(in_tail) if not t]
            if starts:
                out[tensor_on(starts, torch.int64, fresh.device)] = fresh.view(-1, page)[:, 0]
            if continuing:
                assert last_slots is not None
                out[tensor_on(continuing, torch.int64, fresh.device)] = last_slots.to(fresh.device) + 1
            return out
        parts: list[torch.Tensor] = []
        used = 0  # slots of ``fresh`` handed out (always whole pages per request)
        tail_index = 0
        for i, (req, n) in enumerate(zip(reqs, extend_lens)):
            if in_tail[i]:
                assert last_slots is not None
                first = last_slots[tail_index] + 1
                parts.append(first + torch.arange(in_tail[i], device=first.device))
                tail_index += 1
            rest = n - in_tail[i]
            if rest > 0:
                parts.append(fresh[used : used + rest])
                used += -(-rest // page) * page
        return torch.cat([p.to(fresh.device) for p in parts])

    def give_back(self, reqs: Sequence[Request], extend_lens: Sequence[int], slots: torch.Tensor) -> None:
        """Free what :meth:`alloc_for` handed out for a step whose forward failed (the requests'
        ``kv_len`` did not move, so none of them holds these slots): the fresh pages; the slots
        in the tail of a request's last page stay its own."""
        page = self.page_size
        if page == 1:
            self.allocator.free(slots)
            return
        fresh, offset = [], 0
        for req, n in zip(reqs, extend_lens):
            in_tail = min(n, (-req.kv_len) % page)
            if n > in_tail:
                fresh.append(slots[offset + in_tail : offset + n])  # from a fresh page's first slot
            offset += n
        if fresh:
            self.allocator.free(torch.cat(fresh))

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
        """The three disjoint states of every slot, each from its own structure.

        A request owns whole pages: from its locked prefix (page-aligned) to the end of the
        page that holds its last token.
        """
        page = self.page_size
        own = sum(
            -(-r.kv_len // page) * page - r.node.depth for r in live if r.row is not None and r.node is not None
        )
        locked = self.cache.locked_size()
        return PoolUsage(
            total=self.capacity,
            free=self.allocator.num_free(),
            used=own + locked,
            evictable=self.cache.evictable_size(),
            locked=locked,
        )
