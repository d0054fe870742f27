"""CUDA graphs for short prefills: an EXTEND step of one sequence replayed at a bucketed token count.

A prompt of 128 tokens through the 1B runs ~390 kernels for ~1.3 ms of device time, but
launching them from Python takes ~11 ms on the H200: the time to first token
of a short prompt is the host's. A graph captured for a token count replays the whole forward as
one launch. It fixes every address and launch grid, so a step of ``T`` new tokens replays the
graph of the smallest captured count ``N >= T``, its tokens ``[T, N)`` padded so that they
change nothing a real token reads::

    static inputs (width = the largest count)     T = 5 new tokens after a prefix of 3, N = 8
      input_ids       [ 11  52  97  12  40 |  0  0  0 ]   pad: token 0 (any valid id)
      positions       [  3   4   5   6   7 |  0  0  0 ]   pad: position 0 (a valid rotary row)
      out_cache_loc   [903 904 905 906 907 |  0  0  0 ]   pad: slot 0, the pool's dummy slot
      per_seq         [row, prefix 3, extend 5, seq_len 8, last token 4]

The attention reads the lengths from the device (its query blocks past ``extend`` store nothing
and its keys stop at ``prefix + extend``), the last layer and the logits take the row at ``last
token`` only, and every other kernel works row by row: a padded row's values never reach a real
one, and its K/V land in the dummy slot, which no sequence reads.

Outside the graph each step copies its inputs in (one host-to-device copy, then the new slots,
already on the device) and records its real tokens' slots in the request table. The logits are a
``[1, vocab]`` buffer in the model dtype that every prefill graph writes, valid until the next
prefill step. Graphs are captured at start-up, after the decode graphs, into their own memory
pool (one replays at a time).
"""

from __future__ import annotations

import bisect
import functools
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from app.engine.kernel_plan import MIN_PREFILL_GRAPH_TOKENS
from app.engine.cuda_graph import DUMMY_SLOT, PAD_TOKEN, capture_graphs
from app.engine.forward_batch import ForwardBatch, ForwardMode
from app.engine.kv_pool import ReqToTokenPool

if TYPE_CHECKING:
    from app.engine.attention import AttentionBackend
    from app.engine.models import CausalLM

# Slots of the static per-sequence buffer.
ROW, PREFIX_LEN, EXTEND_LEN, SEQ_LEN, LAST_TOKEN = range(5)


@runtime_checkable
class PrefillGraphBackend(Protocol):
    """What an attention backend provides to serve one-sequence EXTEND steps from CUDA graphs."""

    def init_extend_metadata_static(self, num_tokens: int, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                                    extend_lens: torch.Tensor) -> Any:
        """The EXTEND metadata of one sequence of at most ``num_tokens`` new tokens whose lengths
        live in these static ``[1]`` device buffers: its launches depend on ``num_tokens`` alone,
        so a graph captured with it serves every step up to that many tokens."""


def prefill_graph_tokens(max_tokens: int) -> tuple[int, ...]:
    """The token counts to capture for ``prefill-graph-max-tokens=max_tokens``: powers of two
    from 16, and ``max_tokens`` itself, so that a step pads to at most twice its tokens; none for 0.
    (A step of one token never replays one: it runs the decode kernels, eagerly.)"""
    if max_tokens != 0 and max_tokens < MIN_PREFILL_GRAPH_TOKENS:
        raise ValueError(f"prefill-graph-max-tokens must be 0 (off) or at least {MIN_PREFILL_GRAPH_TOKENS}, got "
                         f"{max_tokens}")
    if max_tokens == 0:
        return ()
    counts = {max_tokens}
    count = MIN_PREFILL_GRAPH_TOKENS
    while count < max_tokens:
        counts.add(count)
        count *= 2
    return tuple(sorted(counts))


def graph_token_count(counts: Sequence[int], num_tokens: int) -> int | None:
    """The captured count a step of ``num_tokens`` new tokens replays as (the smallest ``>=``
    it), or None past them all. ``counts`` is sorted."""
    i = bisect.bisect_left(counts, num_tokens)
    return counts[i] if i < len(counts) else None


class StaticExtendInputs:
    """The buffers a captured prefill graph reads; their addresses never change. ``host`` layout:
    ``[input_ids (width) | positions (width) | per_seq (5)]``, so that one copy fills a step."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.width = width
        self.buffer = torch.zeros(2 * width + 5, dtype=torch.int64, device=device)
        self.input_ids = self.buffer[:width]
        self.positions = self.buffer[width:2 * width]
        self.per_seq = self.buffer[2 * width:]
        self.input_ids.fill_(PAD_TOKEN)  # all padding
        self.out_cache_loc = torch.full((width,), DUMMY_SLOT, dtype=torch.int64, device=device)

    def scalar(self, slot: int) -> torch.Tensor:
        """A ``[1]`` view of one per-sequence value (ROW .. LAST_TOKEN)."""
        return self.per_seq[slot:slot + 1]

    def fill(self, count: int, row: int, prefix_len: int, input_ids: Sequence[int], out_cache_loc: torch.Tensor,
             table: ReqToTokenPool) -> None:
        """Load a step of ``T = len(input_ids)`` new tokens after ``prefix_len`` cached ones for the
        graph of ``count >= T`` tokens, and record the real tokens' slots in ``table``. Device ops
        and one pinned copy: no sync."""
        num_tokens = len(input_ids)
        if not 0 < num_tokens <= count <= self.width or out_cache_loc.shape != (num_tokens,):
            raise ValueError(f"fill: {num_tokens} tokens with {tuple(out_cache_loc.shape)} slots do not fit the "
                             f"graph of {count} (width {self.width})")
        if prefix_len + num_tokens > table.max_context_len:
            raise ValueError(f"fill: sequence length {prefix_len + num_tokens} exceeds max_context_len "
                             f"{table.max_context_len}")
        width = self.width
        host = torch.zeros(2 * width + 5, dtype=torch.int64)
        host[:num_tokens] = torch.tensor(input_ids, dtype=torch.int64)
        host[num_tokens:width] = PAD_TOKEN
        host[width:width + num_tokens] = torch.arange(prefix_len, prefix_len + num_tokens, dtype=torch.int64)
        host[2 * width:] = torch.tensor([row, prefix_len, num_tokens, prefix_len + num_tokens, num_tokens - 1])
        # Pinned, so that the copy never waits for the step in flight (see host_to_device.py).
        self.buffer.copy_(host.pin_memory() if self.buffer.is_cuda else host, non_blocking=True)
        self.out_cache_loc[:num_tokens].copy_(out_cache_loc)
        self.out_cache_loc[num_tokens:count].fill_(DUMMY_SLOT)
        table.write(self.scalar(ROW).expand(num_tokens), self.positions[:num_tokens], self.out_cache_loc[:num_tokens])

    def batch(self, count: int, backend: AttentionBackend, attn_metadata: Any) -> ForwardBatch:
        """The ForwardBatch of a ``count``-token graph: views of the static buffers. Its host
        tuples only give the shape (no one reads host lengths inside the graph)."""
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            req_pool_indices=self.scalar(ROW),
            seq_lens=self.scalar(SEQ_LEN),
            prefix_lens=self.scalar(PREFIX_LEN),
            extend_lens=self.scalar(EXTEND_LEN),
            out_cache_loc=self.out_cache_loc[:count],
            positions=self.positions[:count],
            last_token_indices=self.scalar(LAST_TOKEN),
            seq_lens_cpu=(count,),
            prefix_lens_cpu=(0,),
            extend_lens_cpu=(count,),
            attn_backend=backend,
            attn_metadata=attn_metadata,
        )


class PrefillGraphRunner:
    """Serves one-sequence EXTEND steps of up to ``max(token_counts)`` new tokens from graphs
    captured for each of ``token_counts`` (in the constructor) on ``capture_stream``, the model
    runner's. ``capture_stream=None`` captures nothing and runs the same static steps eagerly (a
    CPU checks the padding with it; the engine always captures). Raises ValueError for a backend
    without support, or off CUDA when capturing."""

    def __init__(self, model: CausalLM, backend: AttentionBackend, table: ReqToTokenPool,
                 token_counts: Sequence[int], *, capture_stream: torch.cuda.Stream | None) -> None:
        if not isinstance(backend, PrefillGraphBackend):
            raise ValueError(f"{type(backend).__name__} cannot serve prefills from CUDA graphs; use "
                             "--kernel-options prefill-graph-max-tokens=0")
        if not token_counts or min(token_counts) < 1:
            raise ValueError(f"PrefillGraphRunner: token counts must be positive, got {tuple(token_counts)}")
        device = table.device
        if capture_stream is not None and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}; use --kernel-options "
                             "prefill-graph-max-tokens=0")
        self.model = model
        self.backend = backend
        self.table = table
        self.token_counts = tuple(sorted(set(token_counts)))
        self.inputs = StaticExtendInputs(self.token_counts[-1], device)
        self.logits = torch.empty((1, model.config.vocab_size), dtype=model.dtype, device=device)
        self.batches = {count: self.inputs.batch(count, backend, backend.init_extend_metadata_static(
            count, self.inputs.scalar(ROW), self.inputs.scalar(PREFIX_LEN), self.inputs.scalar(EXTEND_LEN)))
            for count in self.token_counts}
        self.graphs: dict[int, Any] = {}  # token count -> torch.cuda.CUDAGraph
        self.replays: Counter[int] = Counter()  # steps served, by captured count
        self.capture_stream = capture_stream
        if capture_stream is not None:
            self._capture_all(capture_stream)

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.token_counts[-1]

    def replay(self, row: int, prefix_len: int, input_ids: Sequence[int], out_cache_loc: torch.Tensor) -> torch.Tensor:
        """One EXTEND step of one sequence; returns its last token's logits ``[1, vocab]`` in the
        model dtype, the shared buffer that the next prefill step overwrites."""
        count = graph_token_count(self.token_counts, len(input_ids))
        if count is None:
            raise ValueError(f"replay: {len(input_ids)} tokens exceed the largest captured count {self.token_counts[-1]}")
        self.inputs.fill(count, row, prefix_len, input_ids, out_cache_loc.to(self.table.device, torch.int64),
                         self.table)
        if self.graphs:
            self.graphs[count].replay()
        else:
            self._run(count)
        self.replays[count] += 1
        return self.logits

    # ------------------------------------------------------------------ capture

    @torch.inference_mode()
    def _capture_all(self, stream: torch.cuda.Stream) -> None:
        self.graphs = capture_graphs(self.token_counts, lambda count: functools.partial(self._run, count), stream)
        torch.cuda.synchronize(stream.device)

    def _run(self, count: int) -> None:
        """What the graph of ``count`` tokens records: the model over the static inputs, the last
        token's logits written to the shared buffer. At capture the static inputs are padding: row
        0, no prefix, ``count`` tokens at the dummy slot."""
        batch = self.batches[count]
        self.model(self.inputs.input_ids[:count], batch.positions, batch, float_logits=False, logits_out=self.logits)
