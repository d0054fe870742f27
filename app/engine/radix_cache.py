"""Radix-tree prefix cache (RadixAttention): finished and partly prefilled sequences leave their KV
slots in a tree keyed by token ids, so that a later request with the same prefix reuses them.

Each edge holds a run of tokens and the KV slot of each of those tokens::

    root ──[1 2 3]──▶ A ──[4 5]──▶ B            prefix 1 2 3 4 5 → slots of A then of B
                       └──[7 8 9]──▶ C           prefix 1 2 3 7 8 9 → slots of A then of C

A match that ends inside an edge splits it, so that every match ends exactly at a node (the node
the request then locks)::

    match [1 2 9] against             after the split
    root ──[1 2 3 4]──▶ N             root ──[1 2]──▶ M ──[3 4]──▶ N
           s0 s1 s2 s3                       s0 s1         s2 s3

``M`` is new and takes ``N``'s place under ``root``; ``N`` keeps its identity, children, depth and
lock count, so node handles the scheduler holds stay valid across splits.

Ownership of slots (who frees what) is the point of this module; read :meth:`RadixCache.insert`.
Accounting: every token of the tree is either *evictable* (its node is not locked: only the tree
holds it) or *locked* (a running request holds its node or a node below it); the two counts are
disjoint, sum to the tree's size, and :meth:`RadixCache.check` recomputes them from the tree.

With ``page_size > 1`` every edge is a whole number of pages: matches and inserts are rounded down
to a page boundary, so every tensor the cache frees is made of whole pages.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor


class RadixNode:
    """One edge of the tree and the node at its end. Opaque to callers: a handle to lock/unlock."""

    __slots__ = ("parent", "children", "key", "slots", "depth", "lock_ref", "last_access", "id")

    def __init__(self, parent: RadixNode | None, key: tuple[int, ...], slots: Tensor, depth: int, node_id: int) -> None:
        # None for the root and for nodes evicted or dropped by reset (stale handles).
        self.parent = parent
        # Keyed by the first token (page_size 1) or the first page (a tuple) of the child's edge.
        self.children: dict[object, RadixNode] = {}
        self.key = key  # the edge's tokens, from the parent's end to this node's end
        self.slots = slots  # KV slot of each token of ``key``: len(slots) == len(key)
        self.depth = depth  # tokens from the root to the end of this node
        # lock() calls on this node or a node below it, not yet unlocked; > 0 means never evicted.
        self.lock_ref = 0
        self.last_access = 0  # cache clock at the last match/insert through this node (LRU key)
        self.id = node_id  # creation order: breaks LRU ties deterministically

    def __repr__(self) -> str:
        return f"RadixNode(id={self.id}, depth={self.depth}, len={len(self.key)}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    slots: Tensor  # [num_tokens] KV slots of the matched prefix, owned by the tree
    node: RadixNode  # where the match ends: lock it to keep ``slots`` from being evicted
    num_tokens: int  # length of the matched prefix (a multiple of page_size)


class InsertResult(NamedTuple):
    node: RadixNode  # ends at ``num_tokens``: the node to lock if the request goes on running
    num_cached: int  # leading tokens that were already in the tree before this insert
    num_tokens: int  # leading tokens the tree now owns (len rounded down to a page; 0 if disabled)
    slots: Tensor  # [num_tokens] the tree's slots for them: the request's new table entries


class RadixCache:
    """Prefix cache over KV slots. Not thread-safe: one scheduler owns it.

    ``free_slots`` is called with a 1-D ``dtype`` tensor of slots that nobody uses any more
    (evicted, flushed, or duplicates given to :meth:`insert`); it is the pool's ``free``.

    ``disabled`` (``--disable-radix-cache``): matches are empty, the root is the only node, and
    :meth:`insert` takes nothing, so the caller frees every slot itself, by the same rule as when
    enabled (it frees ``slots[result.num_tokens:]``). The tree never frees slots it does not hold:
    an insert for a chunked prefill must not free slots the request still computes on.
    """

    def __init__(
        self,
        free_slots: Callable[[Tensor], None],
        page_size: int = 1,
        disabled: bool = False,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.int64,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.disabled = disabled
        self.device = torch.device(device)
        self.dtype = dtype
        self._free_slots = free_slots
        self._ids = itertools.count()
        self._empty = torch.empty(0, dtype=dtype, device=self.device)
        self._clock = 0
        self._root = self._new_root()
        self._leaves: set[RadixNode] = set()  # nodes without children, root excluded
        self._evictable = 0  # tokens in nodes with lock_ref == 0
        self._locked = 0  # tokens in nodes with lock_ref > 0

    # ------------------------------------------------------------------ queries

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``token_ids`` (whole pages only), splitting the last edge when
        the match ends inside it, and marking the path as just used.

        Does not lock: call :meth:`lock` on ``node`` before anything can evict. The scheduler
        passes the prompt without its last token, so that at least one token is computed (its
        logits give the first output token).
        """
        if self.disabled:
            return MatchResult(self._empty, self._root, 0)
        tokens = tuple(token_ids)
        node, matched, parts = self._walk(tokens, len(tokens) - len(tokens) % self.page_size)
        return MatchResult(self._cat(parts), node, matched)

    def cached_prefix_len(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` are cached (whole pages), changing nothing:
        no split, no access stamp (the waiting queue's order asks it of every waiting request)."""
        if self.disabled:
            return 0
        tokens = tuple(token_ids)
        n = len(tokens) - len(tokens) % self.page_size
        node, i = self._root, 0
        while i < n:
            child = node.children.get(self._child_key(tokens[i : i + self.page_size]))
            if child is None:
                break
            m = self._common_len(child.key, tokens, i, n)
            i += m
            if m < len(child.key):
                break
            node = child
        return i

    def evictable_size(self) -> int:
        """Tokens only the tree holds (unlocked): what :meth:`evict` can give back."""
        return self._evictable

    def locked_size(self) -> int:
        """Tokens of the tree that running requests hold through a lock (disjoint from evictable)."""
        return self._locked

    def total_size(self) -> int:
        """Tokens in the tree."""
        return self._evictable + self._locked

    # ------------------------------------------------------------------ insert / lock

    def insert(self, token_ids: Sequence[int], slots: Tensor, held: RadixNode | None = None) -> InsertResult:
        """Cache the KV of ``token_ids`` (``slots[i]`` holds token ``i``) and take ownership of it.

        ``held`` is the node the caller has locked for this sequence (from :meth:`match_prefix` or
        a previous insert; None or the root if none): ``slots[:held.depth]`` are the tree's own
        slots, which it got from there.

        Who frees what, with ``n = result.num_tokens`` (``len`` rounded down to a page):

        - ``slots[held.depth:n]`` now belong to the tree. Those of tokens already cached
          (``[held.depth:result.num_cached]``, computed twice) are freed here, at once; the rest
          become the new leaf.
        - ``slots[n:]`` (a partial last page; all of them when the cache is disabled) still
          belong to the caller, which frees them when the request ends.
        - The caller replaces its first ``n`` slots with ``result.slots`` (they differ where
          duplicates were freed).

        Locks are not touched: a running request (chunked prefill) locks ``result.node`` and then
        unlocks ``held``; a finished one only unlocks ``held``. See :meth:`lock` for the sequence.

        Raises ValueError if the lengths differ or ``held`` is not on the path of ``token_ids``
        (nothing is inserted or freed then).
        """
        if len(token_ids) != len(slots):
            raise ValueError(f"insert got {len(token_ids)} token ids but {len(slots)} slots")
        if self.disabled:
            return InsertResult(self._root, 0, 0, self._empty)
        held = self._root if held is None else held
        n = len(token_ids) - len(token_ids) % self.page_size
        if held.depth > n:
            raise ValueError(f"held node ends at token {held.depth}, past the {n} tokens being inserted")
        tokens = tuple(token_ids[:n])
        node, cached, parts = self._walk(tokens, n)
        if held is not self._root and not self._on_path(held, node):
            raise ValueError("held node is not on the path of the inserted tokens (stale or foreign handle)")
        if cached < n:
            new_slots = slots[cached:n].to(device=self.device, dtype=self.dtype, copy=True)
            leaf = RadixNode(node, tokens[cached:], new_slots, n, next(self._ids))
            leaf.last_access = self._clock
            node.children[self._child_key(leaf.key)] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self._evictable += n - cached
            parts.append(leaf.slots)
            node = leaf
        if cached > held.depth:
            self._free_slots(slots[held.depth : cached].to(self.dtype))
        return InsertResult(node, cached, n, self._cat(parts))

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (one more reference along the path).

        Protocol for a request (``req.node`` starts as the root):

            m = cache.match_prefix(prompt[:-1]); cache.lock(m.node); req.node = m.node
            ... prefill a chunk or finish ...
            r = cache.insert(tokens_with_kv, req_slots, held=req.node)  # frees duplicates
            req_slots[:r.num_tokens] = r.slots
            if still running: cache.lock(r.node); cache.unlock(req.node); req.node = r.node
            else:             cache.unlock(req.node); pool.free(req_slots[r.num_tokens:])

        Raises ValueError for a node that is no longer in the tree.
        """
        path = self._path(node)
        for n in path:
            if n.lock_ref == 0:
                self._evictable -= len(n.key)
                self._locked += len(n.key)
            n.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        """Undo one :meth:`lock` of ``node``. Raises RuntimeError if it is not locked."""
        if node is not self._root and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of {node!r}, which is not locked")
        for n in self._path(node):
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._locked -= len(n.key)
                self._evictable += len(n.key)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots (whole leaves, least recently used first) if that many
        are evictable, else all that are; return how many were freed. Locked nodes are never
        touched; a parent whose last child goes becomes a leaf and a candidate in turn.

        The freed slots reach ``free_slots`` in one call.
        """
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[Tensor] = []
        count = 0
        while count < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None  # leaves in the tree always have one
            del parent.children[self._child_key(node.key)]
            node.parent = None
            self._leaves.discard(node)
            self._evictable -= len(node.key)
            count += len(node.key)
            freed.append(node.slots)
            if parent is not self._root and not parent.children:
                self._leaves.add(parent)
                if parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if freed:
            self._free_slots(torch.cat(freed))
        return count

    def reset(self) -> None:
        """Drop the whole tree and free its slots (flush_cache). Old node handles become stale.

        Raises RuntimeError if a request still holds a lock: its slots would be freed under it.
        """
        if self._locked:
            raise RuntimeError(f"cannot reset the radix cache: {self._locked} tokens are locked by running requests")
        parts = [n.slots for n in self._nodes()]
        for child in self._root.children.values():
            child.parent = None  # detach: handles below now fail _path() instead of corrupting counts
        self._root.children.clear()
        self._leaves.clear()
        self._evictable = 0
        if parts:
            self._free_slots(torch.cat(parts))

    # ------------------------------------------------------------------ consistency

    def check(self) -> None:
        """Recompute the accounting and structure from the tree; raise RuntimeError on a mismatch.

        O(tree size): for tests and debugging, not for every step.
        """
        evictable = locked = 0
        leaves: set[RadixNode] = set()
        for node in self._nodes():
            problems = []
            parent = node.parent
            if parent is None or parent.children.get(self._child_key(node.key)) is not node:
                problems.append("not linked from its parent")
            if len(node.key) == 0 or len(node.key) % self.page_size:
                problems.append(f"edge length {len(node.key)} is not a positive multiple of the page size")
            if len(node.slots) != len(node.key):
                problems.append(f"{len(node.slots)} slots for {len(node.key)} tokens")
            if parent is not None and node.depth != parent.depth + len(node.key):
                problems.append("depth does not add up")
            if node.lock_ref < sum(c.lock_ref for c in node.children.values()):
                problems.append("lock_ref below the sum of its children's")
            if parent is not None and parent is not self._root and parent.last_access < node.last_access:
                problems.append("accessed later than its parent")
            if problems:
                raise RuntimeError(f"radix cache corrupt at {node!r}: {'; '.join(problems)}")
            if node.lock_ref > 0:
                locked += len(node.key)
            else:
                evictable += len(node.key)
            if not node.children:
                leaves.add(node)
        if (evictable, locked) != (self._evictable, self._locked):
            raise RuntimeError(
                f"radix cache counters say evictable={self._evictable} locked={self._locked}, "
                f"the tree holds evictable={evictable} locked={locked}"
            )
        if leaves != self._leaves:
            raise RuntimeError("radix cache leaf set does not match the tree")

    def all_slots(self) -> Tensor:
        """Every slot the tree holds (for pool audits and tests)."""
        return self._cat([n.slots for n in self._nodes()])

    # ------------------------------------------------------------------ internals

    def _new_root(self) -> RadixNode:
        return RadixNode(None, (), self._empty, 0, next(self._ids))

    def _child_key(self, key: tuple[int, ...]) -> object:
        return key[0] if self.page_size == 1 else key[: self.page_size]

    def _walk(self, tokens: tuple[int, ...], n: int) -> tuple[RadixNode, int, list[Tensor]]:
        """Follow ``tokens[:n]`` down from the root, splitting where the match ends inside an edge
        and stamping every node on the way with a new clock value. Returns the deepest node
        reached, the matched length and the slots of the path."""
        self._clock += 1
        node, i, parts = self._root, 0, []
        while i < n:
            child = node.children.get(tokens[i] if self.page_size == 1 else tokens[i : i + self.page_size])
            if child is None:
                break
            m = self._common_len(child.key, tokens, i, n)  # >= one page: the first page matched
            split = m < len(child.key)
            if split:
                child = self._split(child, m)
            child.last_access = self._clock
            parts.append(child.slots)
            node, i = child, i + m
            if split:  # the tokens diverge from (or end inside) the old edge: nothing below matches
                break
        return node, i, parts

    def _common_len(self, key: tuple[int, ...], tokens: tuple[int, ...], start: int, end: int) -> int:
        """Tokens ``key`` shares with ``tokens[start:end]``, rounded down to a page."""
        n = min(len(key), end - start)
        if key[:n] == tokens[start : start + n]:
            m = n
        else:
            m = next(j for j in range(n) if key[j] != tokens[start + j])
        return m - m % self.page_size

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """Cut ``node``'s edge after ``m`` tokens; return the new upper node (diagram above)."""
        parent = node.parent
        assert parent is not None
        mid = RadixNode(parent, node.key[:m], node.slots[:m].clone(), node.depth - len(node.key) + m, next(self._ids))
        mid.lock_ref = node.lock_ref
        mid.last_access = node.last_access
        node.key, node.slots, node.parent = node.key[m:], node.slots[m:].clone(), mid
        mid.children[self._child_key(node.key)] = node
        parent.children[self._child_key(mid.key)] = mid
        return mid

    def _path(self, node: RadixNode) -> list[RadixNode]:
        """Nodes from ``node`` up to (excluding) the root; ValueError for a stale handle."""
        path = []
        while node is not self._root:
            if node.parent is None:
                raise ValueError(f"{node!r} is no longer in the radix cache (evicted or reset)")
            path.append(node)
            node = node.parent
        return path

    def _on_path(self, ancestor: RadixNode, node: RadixNode) -> bool:
        while node is not self._root:
            if node is ancestor:
                return True
            assert node.parent is not None
            node = node.parent
        return False

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _cat(self, parts: list[Tensor]) -> Tensor:
        if not parts:
            return self._empty
        return parts[0] if len(parts) == 1 else torch.cat(parts)
