"""Several decode steps of one sequence in one CUDA graph replay (``--decode-steps N``).

Why: at batch 1 each step's graph replay is surrounded by a few small kernels that run outside
it (the slot pop, the graph inputs' fill, the greedy record, the tokens' copy out), ~12 us of
a ~0.8 ms step on the H200 (docs/gpu_notes.md, lead 1 (a)), each launched from a stream with a
~2 us gap where the kernels inside a graph follow each other within ~0.1 us. Greedy decoding
needs nothing from the host between two steps: the only link is the token, and the lm_head
gemv already folds its argmax into keys on the device. So N steps go in one graph::

    outside, once:  pop N slots ─ fill the N steps' columns (positions p .. p+N-1, their slots,
                    the request table's N entries) ─ replay ─ record N tokens ─ copy out
    inside:         forward(step 0) ─ token 0 → step 1's input id ─ forward(step 1) ─ ...
                    ─ forward(step N-1) ─ token N-1

Each step's inputs are one column of the graph's static buffers (StaticDecodeInputs with N
columns: the columns are the steps of one sequence, where a batch's are its sequences); after
each forward one small kernel (``step_token``) reads the argmax keys into the step's token and
the next step's input id, and clears them. Only the first step's input id comes from outside.

What it costs: a request that stops inside a run has the rest of the run computed and dropped
(their KV slots go back with the request's other slots), and a streamed request gets its
tokens N at a time. The scheduler takes a run only for one greedy request with at least N
tokens to go (scheduler.py). Without graphs the same run executes eagerly (:func:`run_steps_eager`:
CPU tests, and a device where graphs are off).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from app.engine.cuda_graph import INPUT_IDS, REQ_POOL_INDICES, SEQ_LENS, WARMUP_RUNS, StaticDecodeInputs
from app.engine.forward_batch import ForwardMode
from app.engine.kv_pool import ReqToTokenPool

if TYPE_CHECKING:
    from app.engine.attention import AttentionBackend
    from app.engine.model_runner import ModelRunner
    from app.engine.models import CausalLM


def backend_reads_lengths_on_device(backend: AttentionBackend) -> bool:
    """Whether a decode graph over ``backend`` needs no host work per replay (its metadata are the
    static buffers themselves: the triton backend), so that steps can follow each other inside
    one graph; a backend that plans on the host (flashinfer) cannot."""
    return bool(getattr(backend, "decode_metadata_on_device", False))


class MultiStepGraph:
    """N decode steps of one sequence captured as one CUDA graph (see the module docstring).
    Raises ValueError where it cannot be captured (off CUDA, a backend that plans on the host)."""

    def __init__(self, model: CausalLM, backend: AttentionBackend, table: ReqToTokenPool, steps: int,
                 argmax_keys: torch.Tensor, advance_inputs: bool | None = None) -> None:
        if steps < 2:
            raise ValueError(f"MultiStepGraph: at least two steps, got {steps}")
        if not backend_reads_lengths_on_device(backend):
            raise ValueError(f"{type(backend).__name__} plans decode steps on the host: --decode-steps needs the "
                             "triton decode attention")
        if table.device.type != "cuda":
            raise ValueError(f"MultiStepGraph: CUDA graphs need a CUDA device, got {table.device}")
        self.model = model
        self.backend = backend
        self.table = table
        self.steps = steps
        self.argmax_keys = argmax_keys  # [1, ARGMAX_SLOTS]: folded by each step's lm_head, cleared by step_token
        device = table.device
        self.inputs = StaticDecodeInputs(steps, device, advance=advance_inputs)
        backend.init_cuda_graph_state(1)
        self.tokens = torch.zeros(steps, dtype=torch.int64, device=device)  # step k's token (static)
        self.logits = torch.empty((1, model.config.vocab_size), dtype=model.dtype, device=device)  # scratch
        self.replays = 0
        self.graph = self._capture()

    def replay(self, row: int, prefix_len: int, input_id: Sequence[int] | torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
        """N steps of the sequence in table row ``row`` whose next token sits at ``prefix_len``,
        fed ``input_id`` (one id: on the host, or a device tensor of one) and writing its K/V to
        ``slots`` ``[N]``; returns the N tokens ``[N]`` int64, a static buffer that the next
        replay overwrites (read it, in stream order, before then)."""
        n = self.steps
        if slots.shape != (n,):
            raise ValueError(f"MultiStepGraph.replay: {n} slots expected, got {tuple(slots.shape)}")
        ids: Sequence[int] | torch.Tensor = input_id
        if not isinstance(input_id, torch.Tensor):
            ids = [*input_id, *[0] * (n - len(input_id))]
        self.inputs.fill(n, ids, [row] * n, [prefix_len + k for k in range(n)],
                         slots.to(self.table.device, torch.int64), self.table)
        self.graph.replay()
        self.replays += 1
        return self.tokens

    @torch.inference_mode()
    def _capture(self) -> Any:
        device = self.table.device
        metas = [self.backend.init_forward_metadata_capture(1, self.inputs.view(REQ_POOL_INDICES, 1, k),
                                                            self.inputs.view(SEQ_LENS, 1, k))
                 for k in range(self.steps)]
        batches = [self.inputs.batch(1, self.backend, meta, start=k) for k, meta in enumerate(metas)]
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):  # JIT builds (every step's view alignment) stay out of the graph
                self._run(batches)
        stream.synchronize()
        gc.collect()
        gc.freeze()  # torch.cuda.graph collects garbage before the capture; frozen objects are skipped
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                self._run(batches)
        finally:
            gc.unfreeze()
        self.inputs.warm_up_fill(self.table)
        torch.cuda.synchronize(device)
        self.argmax_keys.zero_()
        return graph

    def _run(self, batches: list[Any]) -> None:
        """What the graph records: each step's forward, then its token handed on."""
        from app.kernels.triton_greedy import step_token  # triton: CUDA only here

        ids = self.inputs.per_seq[INPUT_IDS]
        for k, batch in enumerate(batches):
            self.model(ids[k : k + 1], batch.positions, batch, float_logits=False, argmax_keys=self.argmax_keys,
                       logits_out=self.logits)
            step_token(self.argmax_keys, self.tokens[k : k + 1], ids[k + 1 : k + 2] if k + 1 < self.steps else None)


@torch.inference_mode()
def run_steps_eager(runner: ModelRunner, row: int, prefix_len: int, input_id: Sequence[int] | torch.Tensor,
                    slots: torch.Tensor) -> torch.Tensor:
    """:meth:`MultiStepGraph.replay` without a graph: ``len(slots)`` decode steps one after the
    other, each fed the argmax of the one before (device ops only: nothing waits for the device)."""
    ids: Sequence[int] | torch.Tensor = input_id
    tokens = []
    for k in range(slots.shape[0]):
        logits = runner.forward_eager(ForwardMode.DECODE, [row], [prefix_len + k], [1], ids, slots[k : k + 1])
        ids = logits.argmax(dim=-1)
        tokens.append(ids)
    return torch.cat(tokens).to(torch.int64)
