"""Runs one forward step: turns the scheduler's choice into tensors, calls the model, returns logits.

DECODE steps of up to ``--cuda-graph-max-bs`` sequences replay a captured CUDA graph when
graphs were captured (see cuda_graph.py), and so do EXTEND steps of one sequence of up to
``prefill-graph-max-tokens`` new tokens (prefill_graph.py); every other step runs eagerly.

With ``fused-greedy`` a batch-1 decode step (eager or replayed) also folds the argmax of its
logits into ``argmax_keys`` for the sampler (app/kernels/triton_greedy.py): see
:meth:`ModelRunner.argmax_keys_for`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.engine.attention import AttentionBackend
from app.engine.cuda_graph import CudaGraphRunner
from app.engine.forward_batch import ForwardBatch, ForwardMode
from app.engine.kv_pool import ReqToTokenPool
from app.engine.models import CausalLM
from app.engine.prefill_graph import PrefillGraphRunner


class ModelRunner:
    """The model, its attention backend, the request table it reads, and its decode graphs."""

    def __init__(self, model: CausalLM, attn_backend: AttentionBackend, table: ReqToTokenPool, device: torch.device,
                 *, decode_backend: AttentionBackend | None = None, fused_greedy: bool = False) -> None:
        self.model = model
        self.attn_backend = attn_backend  # prefill (EXTEND) steps, and decode steps unless:
        # --decode-attention-backend: DECODE steps and their graphs attend here (same pool and table).
        self.decode_backend = decode_backend if decode_backend is not None else attn_backend
        self.table = table
        self.device = device
        self.cuda_graphs: CudaGraphRunner | None = None  # set once, at start, by capture_cuda_graphs
        self.prefill_graphs: PrefillGraphRunner | None = None  # likewise, by capture_prefill_graphs
        # fused-greedy: the sampler records all-greedy steps in one kernel (SamplingBatch's
        # record_kernel), and batch-1 decode steps fold their argmax into these keys.
        self.fused_greedy = fused_greedy
        self.argmax_keys: torch.Tensor | None = None
        if fused_greedy and model.writes_argmax_keys():
            from app.kernels.triton_greedy import empty_argmax_keys  # on demand: triton runs here

            self.argmax_keys = empty_argmax_keys(1, device)
        self._capture_stream: torch.cuda.Stream | None = None  # the side stream every graph is captured on

    def capture_stream(self) -> torch.cuda.Stream:
        """The one side stream that the decode and prefill graphs are captured on. Every other
        stream that runs a kernel, at any time, widens the graphs' plain kernel boundaries: ~20 µs
        a decode step on the H200 (a stream that only copies costs nothing), so the captures
        share one. Raises ValueError off CUDA."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}; use --disable-cuda-graph")
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        return self._capture_stream

    def capture_cuda_graphs(self, batch_sizes: Sequence[int], advance_inputs: bool | None = None) -> None:
        """Capture decode graphs for ``batch_sizes`` (at start-up, before any request: no other
        thread may touch CUDA meanwhile; ``advance_inputs``: see CudaGraphRunner). Raises
        ValueError where graphs are not supported."""
        if self.cuda_graphs is not None:
            raise ValueError("capture_cuda_graphs: graphs are already captured")
        self.model.prepare_decode_weights()  # a graph records the weights' addresses: their final ones
        self.cuda_graphs = CudaGraphRunner(self.model, self.decode_backend, self.table, batch_sizes, self.argmax_keys,
                                           advance_inputs, capture_stream=self.capture_stream())

    def capture_prefill_graphs(self, token_counts: Sequence[int]) -> None:
        """Capture graphs of one-sequence EXTEND steps of ``token_counts`` new tokens (at start-up,
        after the decode graphs, as those). Raises ValueError where they are not supported."""
        if self.prefill_graphs is not None:
            raise ValueError("capture_prefill_graphs: graphs are already captured")
        self.model.prepare_decode_weights()  # a graph records the weights' addresses: their final ones
        self.prefill_graphs = PrefillGraphRunner(self.model, self.attn_backend, self.table, token_counts,
                                                 capture_stream=self.capture_stream())

    def backend_for(self, mode: ForwardMode) -> AttentionBackend:
        """The attention backend of a step of ``mode``."""
        return self.decode_backend if mode is ForwardMode.DECODE else self.attn_backend

    def argmax_keys_for(self, mode: ForwardMode, batch_size: int) -> torch.Tensor | None:
        """The argmax keys that a :meth:`forward` of this mode and batch size fills (a batch-1
        DECODE step with ``fused-greedy``, eager or replayed as the batch-1 graph), else None.
        Whoever samples that step's logits must read or clear them (SamplingBatch.sample)."""
        if self.argmax_keys is None or mode is not ForwardMode.DECODE or batch_size != 1:
            return None
        graphs = self.cuda_graphs
        if graphs is not None and graphs.can_run(1) and not graphs.writes_argmax_keys(1):
            return None
        return self.argmax_keys

    @torch.inference_mode()
    def forward(
        self,
        mode: ForwardMode,
        rows: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        input_ids: Sequence[int] | torch.Tensor,
        out_cache_loc: torch.Tensor,
    ) -> torch.Tensor:
        """Compute the new tokens' KV (stored at ``out_cache_loc``) and return logits ``[B, vocab]``
        of each sequence's last new token (float32, or the model dtype from a graph replay; a
        prefill graph's logits stay valid until the next prefill step).
        ``input_ids`` may be a device tensor (a decode step queued before the previous step's
        tokens reached the host). A graph's logits are a view that the next step overwrites:
        use them before then."""
        graphs = self.cuda_graphs
        if mode is ForwardMode.DECODE and graphs is not None and 0 < len(rows) and graphs.can_run(len(rows)):
            if max(extend_lens) != 1:
                raise ValueError(f"ForwardBatch: DECODE extends each sequence by 1 token, got {extend_lens}")
            return graphs.replay(rows, prefix_lens, input_ids, out_cache_loc)
        prefill = self.prefill_graphs
        if mode is ForwardMode.EXTEND and prefill is not None and len(rows) == 1 and extend_lens[0] > 1 \
                and prefill.can_run(extend_lens[0]) and not isinstance(input_ids, torch.Tensor):
            return prefill.replay(rows[0], prefix_lens[0], input_ids, out_cache_loc)
        keys = self.argmax_keys_for(mode, len(rows))
        return self.forward_eager(mode, rows, prefix_lens, extend_lens, input_ids, out_cache_loc, argmax_keys=keys)

    @torch.inference_mode()
    def forward_eager(
        self,
        mode: ForwardMode,
        rows: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        input_ids: Sequence[int] | torch.Tensor,
        out_cache_loc: torch.Tensor,
        *,
        argmax_keys: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` without graphs (every EXTEND step, larger decode batches, tests);
        ``argmax_keys`` as the model's forward takes them."""
        batch = ForwardBatch.build(
            mode=mode,
            req_pool_indices=rows,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            out_cache_loc=out_cache_loc,
            req_to_token_pool=self.table,
            attn_backend=self.backend_for(mode),
        )
        if isinstance(input_ids, torch.Tensor):
            ids = input_ids.to(self.device, torch.int64)
        else:
            ids = torch.tensor(input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.model(ids, batch.positions, batch, argmax_keys=argmax_keys)
