"""KV cache memory: the token-slot buffers, the slot allocator, and the request-to-slots table.

How the pieces index into each other::

    ReqToTokenPool.req_to_token  [max_running_requests, max_context_len] int32
                 pos: 0    1    2    3    4    5
      row 0  (req A) [ 7 ][ 8 ][ 3 ][ 4 ][    ][    ]   seq_len 4
      row 1  (req B) [ 7 ][ 8 ][ 9 ][    ][    ][    ]   seq_len 3: shares A's 2-token prefix
      row 2  (free)  [    ][    ][    ][    ][    ][    ]
                        |    |    |
                        v    v    v
    KVPool.k[layer], KVPool.v[layer]  [num_slots, num_kv_heads, head_dim]
      slot:  0      1   2   3   4   5   6   7   8   9  ...
           [dummy][  ][  ][A2][A3][  ][  ][AB0][AB1][B2] ...
            ^ slot 0 is never handed out: padded (CUDA-graph) tokens write there

The K/V of token ``pos`` of the request in row ``r`` live at slot ``req_to_token[r, pos]`` in every
layer. Slots of one request need not be contiguous, and a cached prefix is shared by pointing two
rows at the same slots. ``SlotAllocator`` hands out and takes back slots (whole pages of
``page_size`` slots); it knows nothing of requests, which the request table and the radix cache track.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from app.engine.model_config import ModelConfig

# Page 0 holds slot 0, the dummy slot; with page_size > 1 the rest of page 0 is unused so that
# every page stays aligned (page p holds slots p*page_size ... p*page_size + page_size - 1).
_RESERVED_PAGES = 1


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one token slot takes across all layers (for sizing the pool from memory)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * itemsize


class SlotAllocator:
    """Free list of KV slots, handed out in whole pages.

    The free list is a stack of page ids in a tensor on ``device``: ``alloc`` pops from its top,
    ``free`` pushes onto it, each a single vectorised copy. Usable capacity is exactly
    ``max_total_tokens``; page 0 (with slot 0) is reserved and never handed out.

    A page has one owner: ``free`` releases every page that any of the given slots lies in.
    On CUDA it does so without reading the device (see :meth:`free`); the slots must then come
    as they always do from our callers: in runs from a page's first slot, a page's slots in
    order (a request's KV from a page-aligned position on, or whole cached pages).

    ``fused_pop`` (default: on CUDA): ``alloc`` pops its pages, marks them taken and expands them
    into slots in one triton kernel (app/kernels/triton_kv_alloc.py) instead of two or three of
    torch's, once before every decode step.
    """

    def __init__(
        self,
        max_total_tokens: int,
        *,
        page_size: int = 1,
        device: torch.device | str = "cpu",
        deferred_checks: bool | None = None,
        fused_pop: bool | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if max_total_tokens < page_size or max_total_tokens % page_size:
            raise ValueError(
                f"max_total_tokens ({max_total_tokens}) must be a positive multiple of page_size ({page_size})"
            )
        self.page_size = page_size
        self.device = torch.device(device)
        self._num_pages = max_total_tokens // page_size
        total_pages = self._num_pages + _RESERVED_PAGES
        # Stack of free page ids; entries [0, _top) are free. Reversed so the first alloc gets page 1.
        self._stack = torch.arange(total_pages - 1, _RESERVED_PAGES - 1, -1, dtype=torch.int64, device=self.device)
        self._top = self._num_pages
        # Per page: is it on the free list? Only to reject double frees and foreign slots.
        self._page_free = torch.ones(total_pages, dtype=torch.bool, device=self.device)
        self._page_free[:_RESERVED_PAGES] = False
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        # On CUDA, free() checks on the device and records a failure here instead of reading the
        # device back (see free); check() raises it. ``deferred_checks`` forces the choice (tests
        # run the deferred path on the CPU, also by setting the attribute before the first free).
        self.deferred_checks = self.device.type == "cuda" if deferred_checks is None else deferred_checks
        self._bad_free = torch.zeros((), dtype=torch.bool, device=self.device)
        self._pop: Callable[..., torch.Tensor] | None = None
        if self.device.type == "cuda" if fused_pop is None else fused_pop:
            from app.kernels.triton_kv_alloc import pop_pages  # triton: only where fused

            self._pop = pop_pages

    @property
    def capacity(self) -> int:
        """Usable slots (``max_total_tokens``), excluding the reserved page."""
        return self._num_pages * self.page_size

    @property
    def num_slots(self) -> int:
        """Rows the KV buffers need: usable slots plus the reserved page."""
        return (self._num_pages + _RESERVED_PAGES) * self.page_size

    def num_free(self) -> int:
        """Free slots, counted from the free list."""
        return self._top * self.page_size

    def free_slots(self) -> torch.Tensor:
        """Every free slot id (int64, sorted), expanded from the free list: for exact accounting."""
        pages = self._stack[: self._top]
        return (pages[:, None] * self.page_size + self._page_offsets).flatten().sort().values

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` slot ids (int64 on ``device``), or None when fewer than ``n`` are free.

        With page_size > 1, ``n`` must be a multiple of page_size; the slots come as whole, aligned
        pages, in ascending order within each page.
        """
        if n < 0 or n % self.page_size:
            raise ValueError(f"alloc: n must be a non-negative multiple of page_size {self.page_size}, got {n}")
        num_pages = n // self.page_size
        if num_pages > self._top:
            return None
        if self._pop is not None and num_pages:
            slots = self._pop(self._stack, self._page_free, self._top, num_pages, self.page_size)
            self._top -= num_pages
            return slots
        top = self._stack[self._top - num_pages : self._top]
        # The last pushed first. One page (a batch-1 decode step): an add kernel, not flip, whose
        # copy of a single element is a copy-engine memcpy that the device started ~9 us after
        # the step's token copy-out (a device trace: lab/tools/trace_gaps.py shows it issued in time).
        pages = top.flip(0) if num_pages > 1 else top + 0
        self._top -= num_pages
        # index_fill_, not ``_page_free[pages] = False``: assigning a Python scalar through an
        # index tensor copies the scalar to the device with a blocking copy, which waits for
        # every step in flight (it halved decode throughput with overlap scheduling on an H200).
        self._page_free.index_fill_(0, pages, False)
        if self.page_size == 1:
            return pages  # a page is a slot: no expansion (two kernels fewer per decode step)
        return (pages[:, None] * self.page_size + self._page_offsets).flatten()

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages of ``slots`` to the free list.

        Raises ValueError, changing nothing, for a reserved or out-of-range slot or a page already
        free (a double free would hand one slot to two requests and corrupt their KV).

        On CUDA the same checks run on the device instead, and a failure is raised by the next
        :meth:`check` (the scheduler calls it whenever it goes idle): reading the device here
        would wait for the step in flight, and requests finish at most steps. With pages of
        several slots the page count must then be known without reading the slots: they must
        come in runs from a page's first slot, each page's slots in order (the last page may be
        cut short), and a run that does not is a failure too.
        """
        if slots.numel() == 0:
            return
        if self.deferred_checks:
            slots = slots.to(device=self.device, dtype=torch.int64)
            if self.page_size == 1:
                self._free_deferred(slots, slots)
            else:
                self._free_deferred(slots[:: self.page_size] // self.page_size, slots)
            return
        pages = torch.unique(slots.to(device=self.device, dtype=torch.int64) // self.page_size)
        if int(pages[0]) < _RESERVED_PAGES or int(pages[-1]) >= self._page_free.numel():
            raise ValueError(f"free: slot ids must lie in [{self.page_size}, {self.num_slots}), got {slots.tolist()}")
        if bool(self._page_free[pages].any()):
            raise ValueError(f"free: double free of slots in pages {pages[self._page_free[pages]].tolist()}")
        self._stack[self._top : self._top + pages.numel()] = pages
        self._top += pages.numel()
        self._page_free.index_fill_(0, pages, True)


    def _free_deferred(self, pages: torch.Tensor, slots: torch.Tensor) -> None:
        """:meth:`free` of distinct ``pages`` (the pages of ``slots``, one per run of page_size
        slots) without a device read: out-of-range, reserved, already free or repeated pages,
        and slots that are not their pages' slots in order, set ``_bad_free``. Only a bug of
        ours frees such slots; the free list is then unsound (a bad entry is pushed as page 0)
        until check() raises, at the latest when the scheduler next goes idle."""
        n = pages.numel()
        valid = (pages >= _RESERVED_PAGES) & (pages < self._page_free.numel())
        safe = torch.where(valid, pages, 0)  # page 0: never free, so it also reads as bad below
        bad = ~valid | self._page_free[safe]
        if self.page_size > 1:  # each run from its page's first slot, in order
            expected = (pages[:, None] * self.page_size + self._page_offsets).flatten()[: slots.numel()]
            bad = bad | (expected != slots).any()
        ordered = pages.sort().values
        self._bad_free |= bad.any() | (ordered[1:] == ordered[:-1]).any()
        self._stack[self._top : self._top + n] = safe
        self._top += n
        self._page_free.index_fill_(0, safe, True)

    def check(self) -> None:
        """Raise RuntimeError if a deferred :meth:`free` was invalid (reads the device once)."""
        if self.deferred_checks and bool(self._bad_free):
            raise RuntimeError("KV slot allocator: a reserved, out-of-range, repeated or already free slot was freed, "
                               "or slots not in runs from a page's first slot")


class KVPool:
    """Per-layer K and V buffers ``[num_slots, num_kv_heads, head_dim]`` in the model dtype.

    Zero-initialised, so never-written slots (the dummy slot, padding) read as finite values.
    """

    def __init__(
        self,
        *,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if min(num_slots, num_layers, num_kv_heads, head_dim) < 1:
            raise ValueError("KVPool: num_slots, num_layers, num_kv_heads and head_dim must all be >= 1")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        self.k: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, config: ModelConfig, *, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> KVPool:
        """Buffers shaped for ``config`` (pass ``SlotAllocator.num_slots``)."""
        return cls(
            num_slots=num_slots,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            device=device,
        )

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[T, num_kv_heads, head_dim]`` of new tokens at slots ``loc`` ``[T]``."""
        self.k[layer_id][loc] = k.to(self.dtype)
        self.v[layer_id][loc] = v.to(self.dtype)


class ReqToTokenPool:
    """Request table: one row of slot ids per running request (see the module diagram).

    Rows are handed out per request, so the free list is a plain list; the table itself lives on
    ``device`` for the attention backends to gather from.
    """

    def __init__(self, max_running_requests: int, max_context_len: int, *, device: torch.device | str = "cpu") -> None:
        if max_running_requests < 1 or max_context_len < 1:
            raise ValueError(
                f"ReqToTokenPool: max_running_requests ({max_running_requests}) and "
                f"max_context_len ({max_context_len}) must be >= 1"
            )
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((max_running_requests, max_context_len), dtype=torch.int32, device=self.device)
        self._free_rows: list[int] = list(range(max_running_requests - 1, -1, -1))  # pop() gives row 0 first
        self._row_free = [True] * max_running_requests

    @property
    def capacity(self) -> int:
        return len(self._row_free)

    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self, n: int = 1) -> list[int] | None:
        """``n`` free row ids, or None when fewer are free."""
        if n < 0:
            raise ValueError(f"alloc: n must be >= 0, got {n}")
        if n > len(self._free_rows):
            return None
        rows = [self._free_rows.pop() for _ in range(n)]
        for row in rows:
            self._row_free[row] = False
        return rows

    def free(self, rows: int | list[int]) -> None:
        """Give rows back; raises ValueError, changing nothing, on a row that is free or out of range."""
        rows = [rows] if isinstance(rows, int) else list(rows)
        bad = [r for r in rows if not 0 <= r < self.capacity or self._row_free[r]]
        if bad or len(set(rows)) != len(rows):
            raise ValueError(f"free: rows {rows} include free, repeated or out-of-range rows {bad}")
        for row in rows:
            self._row_free[row] = True
            self._free_rows.append(row)

    def write(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Record token ``positions[i]`` of request ``rows[i]`` at ``slots[i]`` (all ``[T]``), at once."""
        self.req_to_token[rows, positions] = slots.to(torch.int32)

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slot ids (int64) of positions ``[start, end)`` of ``row``, e.g. to free or to cache them."""
        return self.req_to_token[row, start:end].to(torch.int64)
