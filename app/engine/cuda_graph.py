"""CUDA graphs for DECODE steps: captured once per batch size at start-up, replayed with padding.

A decode step of a 1B model launches a few hundred small kernels, and at small batch Python
takes longer to launch them than the GPU takes to run them. A graph captured for a batch size
replays the whole forward as one launch. A graph fixes every address and every launch grid, so
the step's inputs go into static buffers sized for the largest batch, and a batch of ``b``
sequences replays the graph of the smallest captured size ``bs >= b`` with rows ``[b, bs)``
padded so that they read nothing and write only the pool's dummy slot::

    static inputs (width >= max_bs)             b = 3 real sequences, replayed as bs = 4
      input_ids          [ 11  52  97 |  0 ]    pad: token 0 (any valid id)
      req_pool_indices   [  4   0   7 |  0 ]    pad: row 0 (never read: its seq_len is 0)
      positions          [ 30  12  81 |  0 ]
      seq_lens           [ 31  13  82 |  0 ]    pad: 0, so attention reads no KV and gives zeros
      out_cache_loc      [903  17 412 |  0 ]    pad: slot 0, the pool's reserved dummy slot
      logits [max_bs, vocab] float32: the graph writes rows [0, bs); the step returns [0, b)

Outside the graph, each step copies its inputs in (one host-to-device copy, then on CUDA one
kernel for what is already on the device: the sampled ids and the new slots), records its new
slots in the request table for the real rows only (a padded row must never touch a live row),
and lets the backend fill its own static metadata (:class:`DecodeGraphBackend`). Inside the
graph there is no host sync and no allocation that depends on values.

All graphs share one memory pool (one replays at a time) and write their logits into one shared
buffer, so memory grows with the largest size only. Capture happens in ``build_scheduler``,
before the server reports ready, while no other thread touches CUDA.
"""

from __future__ import annotations

import bisect
import functools
import gc
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from app.engine.forward_batch import ForwardBatch, ForwardMode
from app.engine.kv_pool import ReqToTokenPool
# The static inputs' rows and the pool's dummy slot, shared with the kernel that fills them.
from app.kernels.graph_input_layout import DUMMY_SLOT, INPUT_IDS, POSITIONS, REQ_POOL_INDICES, SEQ_LENS

if TYPE_CHECKING:
    from app.engine.attention import AttentionBackend
    from app.engine.models import CausalLM

DEFAULT_CUDA_GRAPH_MAX_BS = 256  # our default --max-running-requests: full decode batches replay too
PAD_TOKEN = 0  # any valid token id: the padded rows' outputs are never read
PAD_ROW = 0  # a valid request-table row; with seq_len 0 it is never read
WARMUP_RUNS = 2  # eager runs before each capture: JIT builds and library handles stay out of the graph


@runtime_checkable
class DecodeGraphBackend(Protocol):
    """What an attention backend provides to serve decode steps from CUDA graphs."""

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate the static metadata buffers for batches of up to ``max_bs`` (once)."""

    def init_forward_metadata_capture(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> Any:
        """The decode metadata of a ``bs`` batch whose tensors live in the static buffers (the
        arguments are static too); a captured graph keeps reading them."""

    def init_forward_metadata_replay(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: Sequence[int]
    ) -> None:
        """Fill the static metadata for this step's inputs (already in the static buffers) before
        the graph of size ``bs`` replays, with device ops and host work that reads no device value
        (no sync). ``seq_lens_cpu`` are the host lengths of the step's ``b = len(seq_lens_cpu)``
        real sequences, rows ``[0, b)``; rows ``[b, bs)`` are padding."""


def capture_batch_sizes(max_bs: int) -> tuple[int, ...]:
    """The batch sizes to capture for ``--cuda-graph-max-bs max_bs``: 1, 2, 4, 8, then every
    multiple of 8 from 16, and ``max_bs`` itself, so no batch pads by more than 7 rows past 8."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be at least 1, got {max_bs}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_bs} | set(range(16, max_bs + 1, 8)) | {max_bs}
    return tuple(sorted(sizes))


def graph_batch_size(batch_sizes: Sequence[int], b: int) -> int | None:
    """The captured size a batch of ``b`` replays as (the smallest ``>= b``), or None when ``b``
    exceeds them all (the step runs eagerly). ``batch_sizes`` is sorted."""
    i = bisect.bisect_left(batch_sizes, b)
    return batch_sizes[i] if i < len(batch_sizes) else None


def capture_graphs(sizes: Sequence[int], make_run: Callable[[int], Callable[[], None]],
                   stream: torch.cuda.Stream) -> dict[int, Any]:
    """A CUDA graph of ``make_run(size)()`` for each of ``sizes`` (decode batch sizes, prefill token
    counts), keyed by size: largest first, all in one new memory pool (one replays at a time, so
    the smaller reuse the largest's memory), each after WARMUP_RUNS eager runs on the same side
    stream ``stream``: the model runner's one capture stream (another stream running kernels
    slows every decode step, and so did the warm-up runs on the default stream instead).
    ``make_run(size)`` is called once a size, before its runs, off the side stream (the size's
    static metadata). Call under inference mode, at start-up."""
    pool = torch.cuda.graph_pool_handle()
    stream.wait_stream(torch.cuda.current_stream(stream.device))  # the static buffers' initialisation
    graphs: dict[int, Any] = {}
    # torch.cuda.graph collects garbage before each capture; frozen objects are skipped.
    gc.collect()
    gc.freeze()
    try:
        for size in sorted(set(sizes), reverse=True):
            run = make_run(size)
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    run()
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                run()
            graphs[size] = graph
    finally:
        gc.unfreeze()
    return graphs


def padded_decode_inputs(
    input_ids: Sequence[int], rows: Sequence[int], prefix_lens: Sequence[int], width: int
) -> list[list[int]]:
    """The host side of a step's static inputs, ``width`` columns per row (rows indexed by
    INPUT_IDS, REQ_POOL_INDICES, POSITIONS, SEQ_LENS); columns past the batch are padding.
    A decoded token sits at position ``prefix_len`` and makes the sequence ``prefix_len + 1`` long."""
    b = len(rows)
    if not 0 < b <= width or len(input_ids) != b or len(prefix_lens) != b:
        raise ValueError(
            f"padded_decode_inputs: need 1..{width} sequences with one input id and prefix_len each, got "
            f"{b} rows, {len(input_ids)} ids, {len(prefix_lens)} prefix_lens"
        )
    pad = width - b
    return [
        [*input_ids, *[PAD_TOKEN] * pad],
        [*rows, *[PAD_ROW] * pad],
        [*prefix_lens, *[0] * pad],
        [*(p + 1 for p in prefix_lens), *[0] * pad],
    ]


class StaticDecodeInputs:
    """The buffers a captured decode graph reads; their addresses never change.

    ``per_seq`` is ``[4, width]`` int64 (rows INPUT_IDS .. SEQ_LENS), so that one copy fills a
    step and ``per_seq[k, :bs]`` is a contiguous view; ``width`` is ``max_bs`` rounded up to 8
    so that every view starts 64-byte aligned.

    ``fused`` (default: on CUDA): after the host copy, one triton kernel moves the device-side
    inputs in (the sampled ids, the new slots and their padding, the request table's entries:
    app/kernels/triton_graph_inputs.py) instead of torch's four to five small kernels.

    ``advance`` (with ``fused``; default: on with it): a step of the same sequences in the same
    graph as the step before, each one token further and its ids on the device (every steady
    decode step with overlap), skips the host copy: the kernel moves the positions and lengths
    on in place.
    """

    def __init__(self, max_bs: int, device: torch.device, *, fused: bool | None = None,
                 advance: bool | None = None) -> None:
        self.max_bs = max_bs
        self.fused = torch.device(device).type == "cuda" if fused is None else fused
        if advance and not self.fused:
            raise ValueError("StaticDecodeInputs: advance needs the fused fill (its kernel moves the columns on)")
        self.advance = self.fused if advance is None else advance
        # The last fill's (bs, rows, prefix_lens), while ``per_seq`` holds exactly that step.
        self._last: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None
        self.advanced_fills = 0  # fills that skipped the host copy
        self._load_fused: Callable[..., None] | None = None
        if self.fused:
            from app.kernels.triton_graph_inputs import load_graph_inputs  # triton: only where fused

            self._load_fused = load_graph_inputs
        self.width = -(-max_bs // 8) * 8
        self.per_seq = torch.zeros((4, self.width), dtype=torch.int64, device=device)  # all padding
        self.per_seq[INPUT_IDS] = PAD_TOKEN
        self.per_seq[REQ_POOL_INDICES] = PAD_ROW
        self.out_cache_loc = torch.full((self.width,), DUMMY_SLOT, dtype=torch.int64, device=device)
        self.extend_lens = torch.ones(self.width, dtype=torch.int64, device=device)
        self.last_token_indices = torch.arange(self.width, dtype=torch.int64, device=device)

    def view(self, row: int, bs: int) -> torch.Tensor:
        return self.per_seq[row, :bs]

    def fill(
        self,
        bs: int,
        input_ids: Sequence[int] | torch.Tensor,
        rows: Sequence[int],
        prefix_lens: Sequence[int],
        out_cache_loc: torch.Tensor,
        table: ReqToTokenPool,
    ) -> None:
        """Load a step of ``b = len(rows)`` sequences for the graph of size ``bs >= b`` and record
        each real sequence's new slot at ``req_to_token[row, prefix_len]``. Device ops only.
        ``input_ids`` on the device (the previous step's samples, not yet on the host) are copied
        in after the host-side columns."""
        b = len(rows)
        if b > bs or bs > self.max_bs or out_cache_loc.shape != (b,):
            raise ValueError(f"fill: {b} sequences with {tuple(out_cache_loc.shape)} slots do not fit size {bs}")
        if max(prefix_lens) + 1 > table.max_context_len:
            raise ValueError(f"fill: sequence length {max(prefix_lens) + 1} exceeds max_context_len {table.max_context_len}")
        on_device = isinstance(input_ids, torch.Tensor)
        step = (bs, tuple(rows), tuple(prefix_lens))
        last, self._last = self._last, None  # until this fill has been queued
        if self._load_fused is not None and self.advance and on_device and last is not None \
                and last[:2] == step[:2] and all(p == q + 1 for p, q in zip(step[2], last[2])):
            self._load_fused(self.per_seq, input_ids, out_cache_loc, self.out_cache_loc, table.req_to_token, bs,
                             advance=True)
            self._last = step
            self.advanced_fills += 1
            return
        host_ids = [PAD_TOKEN] * b if on_device else input_ids
        host = torch.tensor(padded_decode_inputs(host_ids, rows, prefix_lens, self.width), dtype=torch.int64)
        # Pinned, so that the copy never waits for the step in flight (see host_to_device.py).
        self.per_seq.copy_(host.pin_memory() if self.per_seq.is_cuda else host, non_blocking=True)
        if self._load_fused is not None:
            self._load_fused(self.per_seq, input_ids if on_device else None, out_cache_loc, self.out_cache_loc,
                             table.req_to_token, bs)
            self._last = step
            return
        if on_device:
            self.per_seq[INPUT_IDS, :b].copy_(input_ids)
        self.out_cache_loc[:b].copy_(out_cache_loc)
        self.out_cache_loc[b:bs].fill_(DUMMY_SLOT)
        table.write(self.view(REQ_POOL_INDICES, b), self.view(POSITIONS, b), self.out_cache_loc[:b])

    def warm_up_fill(self, table: ReqToTokenPool) -> None:
        """Run :meth:`fill` once with ids from the host, once with ids on the device and once a step
        further (the advancing fill), into a scratch request table shaped like ``table``, so that
        the fused fill's kernels compile at start-up rather than at the first replays (the live
        table is not touched); the next fill copies every column again."""
        scratch = ReqToTokenPool(1, table.max_context_len, device=table.device)
        slot = torch.full((1,), DUMMY_SLOT, dtype=torch.int64, device=self.per_seq.device)
        ids = torch.full((1,), PAD_TOKEN, dtype=torch.int64, device=self.per_seq.device)
        self.fill(1, [PAD_TOKEN], [PAD_ROW], [0], slot, scratch)
        self.fill(1, ids, [PAD_ROW], [0], slot, scratch)
        self.fill(1, ids, [PAD_ROW], [1], slot, scratch)
        self._last = None
        self.advanced_fills = 0

    def batch(self, bs: int, backend: AttentionBackend, attn_metadata: Any) -> ForwardBatch:
        """The ForwardBatch of a ``bs`` graph: views of the static buffers. Its host tuples only
        give the batch size (the triton backend reads no host lengths in DECODE)."""
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            req_pool_indices=self.view(REQ_POOL_INDICES, bs),
            seq_lens=self.view(SEQ_LENS, bs),
            prefix_lens=self.view(POSITIONS, bs),
            extend_lens=self.extend_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            positions=self.view(POSITIONS, bs),
            last_token_indices=self.last_token_indices[:bs],
            seq_lens_cpu=(0,) * bs,
            prefix_lens_cpu=(0,) * bs,
            extend_lens_cpu=(1,) * bs,
            attn_backend=backend,
            attn_metadata=attn_metadata,
        )


class CudaGraphRunner:
    """Captures the model's decode step for each of ``batch_sizes`` (in the constructor) and
    replays them. Raises ValueError for a backend without graph support or off CUDA.
    ``argmax_keys`` (``fused-greedy``): the batch-1 graph also folds its argmax into them
    (static, like the other buffers; the sampler clears them after each replay).
    ``advance_inputs`` (``graph-inputs-advance``): StaticDecodeInputs' ``advance``.
    ``capture_stream``: the side stream to capture on, the model runner's one."""

    def __init__(self, model: CausalLM, backend: AttentionBackend, table: ReqToTokenPool, batch_sizes: Sequence[int],
                 argmax_keys: torch.Tensor | None = None, advance_inputs: bool | None = None, *,
                 capture_stream: torch.cuda.Stream | None) -> None:
        if not isinstance(backend, DecodeGraphBackend):
            raise ValueError(f"{type(backend).__name__} cannot serve decode from CUDA graphs; use --disable-cuda-graph")
        if not batch_sizes:
            raise ValueError("CudaGraphRunner: no batch sizes to capture")
        self.model = model
        self.backend = backend
        self.table = table
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_bs = self.batch_sizes[-1]
        device = table.device
        self.inputs = StaticDecodeInputs(self.max_bs, device, advance=advance_inputs)
        backend.init_cuda_graph_state(self.max_bs)
        # Shared by every graph: each writes rows [0, bs); a step reads its rows before the next replay.
        # In the model dtype: sampling converts what it needs (greedy rows need nothing).
        self.logits = torch.empty((self.max_bs, model.config.vocab_size), dtype=model.dtype, device=device)
        self.argmax_keys = argmax_keys
        self.graphs: dict[int, Any] = {}  # batch size -> torch.cuda.CUDAGraph
        self.replays: Counter[int] = Counter()  # steps served, by real batch size b
        self.capture_stream = capture_stream  # the model runner's (None only where a subclass captures nothing)
        self._capture_all()

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def writes_argmax_keys(self, batch_size: int) -> bool:
        """Whether a replay of ``batch_size`` sequences fills the argmax keys (the batch-1 graph)."""
        return self.argmax_keys is not None and graph_batch_size(self.batch_sizes, batch_size) == 1

    def replay(
        self,
        rows: Sequence[int],
        prefix_lens: Sequence[int],
        input_ids: Sequence[int] | torch.Tensor,
        out_cache_loc: torch.Tensor,
    ) -> torch.Tensor:
        """One decode step of ``len(rows) <= max_bs`` sequences; returns logits ``[b, vocab]`` in the
        model dtype, a view of the shared buffer that the next replay overwrites."""
        b = len(rows)
        bs = graph_batch_size(self.batch_sizes, b)
        if bs is None:
            raise ValueError(f"replay: batch of {b} exceeds the largest captured size {self.max_bs}")
        self.inputs.fill(bs, input_ids, rows, prefix_lens, out_cache_loc.to(self.table.device, torch.int64), self.table)
        self.backend.init_forward_metadata_replay(
            bs, self.inputs.view(REQ_POOL_INDICES, bs), self.inputs.view(SEQ_LENS, bs), [p + 1 for p in prefix_lens]
        )
        self.graphs[bs].replay()
        self.replays[b] += 1
        return self.logits[:b]

    # ------------------------------------------------------------------ capture

    @torch.inference_mode()
    def _capture_all(self) -> None:
        device = self.table.device
        if device.type != "cuda" or self.capture_stream is None:
            raise ValueError(f"CUDA graphs need a CUDA device and a capture stream, got {device} and "
                             f"{self.capture_stream}; use --disable-cuda-graph")
        self.graphs = capture_graphs(self.batch_sizes,
                                     lambda bs: functools.partial(self._run, bs, self._static_batch(bs)),
                                     self.capture_stream)
        self.inputs.warm_up_fill(self.table)
        torch.cuda.synchronize(device)
        if self.argmax_keys is not None:
            self.argmax_keys.zero_()  # the warm-up runs folded theirs: empty for the first step

    def _static_batch(self, bs: int) -> ForwardBatch:
        inputs = self.inputs
        meta = self.backend.init_forward_metadata_capture(bs, inputs.view(REQ_POOL_INDICES, bs), inputs.view(SEQ_LENS, bs))
        return inputs.batch(bs, self.backend, meta)

    def _run(self, bs: int, batch: ForwardBatch) -> None:
        """What a graph of size ``bs`` records: the model over the static inputs, logits copied out."""
        keys = self.argmax_keys if bs == 1 else None
        # The output projection writes the shared buffer itself (no copy: 65 MB a step at 256 rows).
        self.model(self.inputs.view(INPUT_IDS, bs), batch.positions, batch, float_logits=False, argmax_keys=keys,
                   logits_out=self.logits[:bs])
