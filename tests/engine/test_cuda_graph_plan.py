"""The host-side parts of decode CUDA graphs, on the CPU: which sizes are captured, which one a
batch replays as, how its rows are padded, what lands in the static buffers and the request
table, and when graphs are used at all. Capture and replay themselves are in
test_cuda_graph_gpu.py."""

from __future__ import annotations

import os
import random
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

from app.engine.builder import cuda_graph_batch_sizes
from app.engine.config import EngineConfig
from app.engine.cuda_graph import (
    DUMMY_SLOT,
    CudaGraphRunner,
    INPUT_IDS,
    POSITIONS,
    REQ_POOL_INDICES,
    SEQ_LENS,
    StaticDecodeInputs,
    capture_batch_sizes,
    graph_batch_size,
    padded_decode_inputs,
)
from app.engine.engine import Engine
from app.engine.forward_batch import ForwardMode
from app.engine.kv_pool import ReqToTokenPool
from app.engine.make_checkpoint import ModelSpec, make_checkpoint
from app.engine.request import Request, Status
from app.engine.sampling import request_seed
from app.ipc.messages import SamplingParams, unpack_tokens
from app.server_args import parse_server_args


def test_capture_sizes_double_to_8_then_step_by_8_and_end_at_max():
    assert capture_batch_sizes(1) == (1,)
    assert capture_batch_sizes(5) == (1, 2, 4, 5)
    assert capture_batch_sizes(16) == (1, 2, 4, 8, 16)
    assert capture_batch_sizes(30) == (1, 2, 4, 8, 16, 24, 30)
    sizes = capture_batch_sizes(256)
    assert sizes[:6] == (1, 2, 4, 8, 16, 24) and sizes[-1] == 256 and len(sizes) == 35
    assert all(b - a <= 8 for a, b in zip(sizes, sizes[1:]))
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        capture_batch_sizes(0)


@pytest.mark.parametrize("max_bs", [1, 7, 16, 30, 160, 256])
def test_every_batch_replays_the_smallest_size_that_holds_it(max_bs):
    sizes = capture_batch_sizes(max_bs)
    for b in range(1, max_bs + 1):
        bs = graph_batch_size(sizes, b)
        assert bs is not None and bs >= b
        assert all(s < b for s in sizes if s < bs)  # no smaller captured size would do
        assert bs - b < 8  # padding stays small
    assert graph_batch_size(sizes, max_bs + 1) is None  # larger batches run eagerly


def test_padding_reads_nothing_and_writes_the_dummy_slot():
    host = padded_decode_inputs(input_ids=[11, 52, 97], rows=[4, 0, 7], prefix_lens=[30, 12, 81], width=8)
    assert host[INPUT_IDS] == [11, 52, 97, 0, 0, 0, 0, 0]
    assert host[REQ_POOL_INDICES] == [4, 0, 7, 0, 0, 0, 0, 0]
    assert host[POSITIONS] == [30, 12, 81, 0, 0, 0, 0, 0]
    assert host[SEQ_LENS] == [31, 13, 82, 0, 0, 0, 0, 0]  # the new token counts; padding: no context
    with pytest.raises(ValueError):
        padded_decode_inputs([1] * 9, list(range(9)), [0] * 9, width=8)
    with pytest.raises(ValueError):
        padded_decode_inputs([1, 2], [0, 1], [0], width=8)


def test_static_inputs_fill_pads_stale_rows_and_writes_only_real_rows_of_the_table():
    table = ReqToTokenPool(8, 96)
    table.req_to_token[0, 0] = 99  # a live row 0: padding (row 0, position 0) must not touch it
    inputs = StaticDecodeInputs(max_bs=20, device=torch.device("cpu"))
    assert inputs.width == 24 and inputs.per_seq.shape == (4, 24)
    # A larger step first, so that the smaller one must overwrite stale rows with padding.
    inputs.fill(8, [5] * 6, [1, 2, 3, 4, 5, 6], [9] * 6, torch.arange(100, 106), table)
    inputs.fill(4, [11, 52, 97], [4, 0, 7], [30, 12, 81], torch.tensor([903, 17, 412]), table)
    assert inputs.view(INPUT_IDS, 4).tolist() == [11, 52, 97, 0]
    assert inputs.view(REQ_POOL_INDICES, 4).tolist() == [4, 0, 7, 0]
    assert inputs.view(POSITIONS, 4).tolist() == [30, 12, 81, 0]
    assert inputs.view(SEQ_LENS, 4).tolist() == [31, 13, 82, 0]
    assert inputs.out_cache_loc[:4].tolist() == [903, 17, 412, DUMMY_SLOT]
    assert table.req_to_token[4, 30] == 903 and table.req_to_token[0, 12] == 17 and table.req_to_token[7, 81] == 412
    assert table.req_to_token[0, 0] == 99
    batch = inputs.batch(4, backend=None, attn_metadata=None)  # type: ignore[arg-type]
    assert batch.batch_size == 4 and batch.num_tokens == 4
    assert batch.positions.data_ptr() == inputs.per_seq[POSITIONS].data_ptr()  # views, not copies
    assert batch.last_token_indices.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        inputs.fill(2, [1, 2, 3], [0, 1, 2], [0, 0, 0], torch.tensor([1, 2, 3]), table)  # 3 rows, size 2
    with pytest.raises(ValueError, match="max_context_len"):
        inputs.fill(1, [1], [0], [96], torch.tensor([5]), table)


@pytest.mark.parametrize(
    ("changes", "device", "backend", "expected_max"),
    [
        ({}, "cuda", "triton", 256),
        ({}, "cpu", "torch", None),
        ({}, "cpu", "triton", None),  # the triton interpreter on a CPU: no graphs
        ({}, "cuda", "torch", None),
        ({}, "cuda", "flashinfer", 256),
        ({"disable_cuda_graph": True}, "cuda", "triton", None),
        ({"cuda_graph_max_bs": 48}, "cuda", "triton", 48),
        ({"cuda_graph_max_bs": 1000}, "cuda", "triton", 256),  # capped by the running requests
    ],
)
def test_when_graphs_are_captured(changes, device, backend, expected_max):
    config = EngineConfig(model_path=".", **changes)
    sizes = cuda_graph_batch_sizes(config, torch.device(device), backend, max_running=256)
    assert (max(sizes) if sizes else None) == expected_max
    small = cuda_graph_batch_sizes(EngineConfig(model_path="."), torch.device("cuda"), "triton", max_running=12)
    assert small == (1, 2, 4, 8, 12)


def test_flags():
    args = parse_server_args(["--cuda-graph-max-bs", "64", "--disable-cuda-graph"])
    config = args.engine_config(".")
    assert config.cuda_graph_max_bs == 64 and config.disable_cuda_graph
    assert not parse_server_args([]).engine_config(".").disable_cuda_graph
    with pytest.raises(ValueError, match="--cuda-graph-max-bs"):
        EngineConfig(model_path=".", cuda_graph_max_bs=0).validate()


# ---------------------------------------------------------------------- scripted runs (CPU and GPU)


class Join(NamedTuple):
    step: int  # the scheduler step before which the request arrives
    prompt_len: int
    max_new_tokens: int


@dataclass
class Collected:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top2: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class ScriptRun:
    results: dict[str, Collected]
    decode_sizes: list[int]  # the batch size of every decode step, in order


def run_script(engine: Engine, script: list[Join], seed: int = 3) -> ScriptRun:
    """Drive ``engine``'s scheduler step by step; requests join at their step and leave when
    their max_new_tokens are done, so decode batches grow and shrink through many sizes.
    Greedy, with the chosen and top-2 logprobs of every token. Starts from an empty prefix
    cache: an engine that ran the script before would otherwise prefill from cache hits, and
    its decode batches would take other sizes."""
    scheduler = engine.scheduler
    assert not scheduler.has_work() and scheduler.memory.flush_cache()
    rng = random.Random(seed)
    vocab = engine.built.model_config.vocab_size
    pending = sorted(script)
    results: dict[str, Collected] = {}
    decode_sizes: list[int] = []
    step = 0
    while pending or scheduler.has_work():
        while pending and pending[0].step <= step:
            join = pending.pop(0)
            params = SamplingParams(max_new_tokens=join.max_new_tokens, temperature=0.0, ignore_eos=True,
                                    logprobs=True, top_logprobs=2)
            rid = f"r{len(results)}"
            scheduler.add_request(Request(rid, [rng.randrange(vocab) for _ in range(join.prompt_len)], params,
                                          request_seed(params)))
            results[rid] = Collected()
        if scheduler.running and not scheduler.waiting and scheduler.prefilling is None:
            decode_sizes.append(len(scheduler.running))
        for out in scheduler.step():
            got = results[out.rid]
            got.tokens.extend(unpack_tokens(out.token_ids))
            if out.logprobs is not None:
                chosen, top = array("f"), array("f")
                chosen.frombytes(out.logprobs.chosen)
                top.frombytes(out.logprobs.top_logprobs)
                got.logprobs.extend(chosen)
                got.top2.extend(zip(top[0::2], top[1::2]))
        step += 1
    return ScriptRun(results, decode_sizes)


def assert_same_greedy(expected: ScriptRun, got: ScriptRun, tol: float) -> int:
    """Tokens equal wherever the expected run's top-2 gap is at least ``tol`` (a request's
    comparison stops at its first near tie), chosen logprobs within ``tol``; returns how many
    positions were compared."""
    assert expected.decode_sizes == got.decode_sizes
    compared = 0
    for rid, want in expected.results.items():
        have = got.results[rid]
        assert len(have.tokens) == len(want.tokens), rid
        for i, (a, b) in enumerate(zip(want.tokens, have.tokens)):
            best, second = want.top2[i]
            if best - second < tol:
                break
            assert a == b, f"{rid} position {i}"
            assert abs(want.logprobs[i] - have.logprobs[i]) < tol, f"{rid} position {i}"
            compared += 1
    return compared


def decode_step_inputs(engine: Engine) -> tuple[list[int], list[int], list[int]]:
    """Rows, prefix lengths and input ids of a decode step over every running request."""
    running = engine.scheduler.running
    assert running and all(r.status is Status.RUNNING for r in running)
    return [r.row for r in running], [r.kv_len for r in running], [r.output_ids[-1] for r in running]  # type: ignore[misc]


# ---------------------------------------------------------------------- replay logic on a CPU


class EagerReplayRunner(CudaGraphRunner):
    """The graph runner with each "graph" run eagerly over the static buffers: everything but the
    capture itself (padding, static metadata, the table write, logits slicing) runs on a CPU."""

    def _capture_all(self) -> None:
        for bs in self.batch_sizes:
            batch = self._static_batch(bs)
            self.graphs[bs] = SimpleNamespace(replay=lambda bs=bs, batch=batch: self._run(bs, batch))


CPU_SPEC = ModelSpec(num_layers=2, hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=2, head_dim=32,
                     vocab_size=1024, max_position_embeddings=256, rope_theta=10_000.0, dtype="float32", seed=5,
                     init_std=0.09)
CPU_SCRIPT = [Join(0, 5, 5), Join(0, 9, 7), Join(0, 13, 3), Join(3, 7, 4), Join(3, 20, 10)]


@pytest.fixture(scope="module")
def interpreted_triton(tmp_path_factory):
    """Two float32 engines on the CPU with the triton backend (interpreted), one with replay
    logic for sizes 1, 2, 4, one without. Skipped unless triton runs interpreted (tests/kernels'
    conftest sets TRITON_INTERPRET=1 on machines without CUDA) or compiled (CUDA)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (run together with tests/kernels)")
    path = make_checkpoint(tmp_path_factory.mktemp("cuda-graph-cpu") / "model", CPU_SPEC)
    common = dict(device="cpu", dtype="float32", attention_backend="triton", max_total_tokens=2048,
                  max_running_requests=8, chunked_prefill_size=16)
    graphed, eager = Engine(str(path), **common), Engine(str(path), **common)
    for engine in (graphed, eager):
        engine.scheduler.runner.attn_backend.max_kv_splits = 2  # fewer interpreted programs; still split
    runner = graphed.scheduler.runner
    runner.cuda_graphs = EagerReplayRunner(runner.model, runner.attn_backend, runner.table, (1, 2, 4),
                                           capture_stream=None)
    return graphed, eager


def test_replay_logic_gives_the_eager_tokens_through_joins_leaves_and_padding(interpreted_triton):
    graphed, eager = interpreted_triton
    expected, got = run_script(eager, CPU_SCRIPT), run_script(graphed, CPU_SCRIPT)
    assert assert_same_greedy(expected, got, tol=1e-4) >= len(CPU_SCRIPT)
    replays = graphed.scheduler.runner.cuda_graphs.replays
    assert {1, 3, 4} <= set(replays), got.decode_sizes  # exact sizes, and 3 padded to 4
    assert max(got.decode_sizes) > 4  # and eager steps past the largest size
    for engine in (graphed, eager):
        usage = engine.scheduler.stats().usage
        assert usage.consistent and usage.used == 0


def test_replayed_logits_equal_eager_ones_and_padding_writes_only_the_dummy_slot(interpreted_triton):
    engine, _ = interpreted_triton
    scheduler, runner = engine.scheduler, engine.scheduler.runner
    rng = random.Random(11)
    params = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((4, 11, 30)):
        scheduler.add_request(Request(f"l{i}", [rng.randrange(CPU_SPEC.vocab_size) for _ in range(n)], params, 0))
    while scheduler.waiting or scheduler.prefilling is not None:
        scheduler.step()
    pool = scheduler.memory.pool
    live = [slot for r in scheduler.running for slot in scheduler.memory.table.slots(r.row, 0, r.kv_len).tolist()]
    before = torch.stack([pool.k[0][live], pool.v[1][live]])
    rows, prefix_lens, ids = decode_step_inputs(engine)
    slots = scheduler.memory.alloc(len(rows))
    replayed = runner.forward(ForwardMode.DECODE, rows, prefix_lens, [1] * 3, ids, slots).clone()
    eager = runner.forward_eager(ForwardMode.DECODE, rows, prefix_lens, [1] * 3, ids, slots)
    assert replayed.shape == eager.shape == (3, CPU_SPEC.vocab_size)
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.stack([pool.k[0][live], pool.v[1][live]]), before)  # the pad row wrote slot 0 only
    scheduler.memory.allocator.free(slots)
    scheduler.abort(None)
    scheduler.step()  # hands out the aborted requests' final outputs
    usage = scheduler.stats().usage
    assert usage.consistent and usage.used == 0
