"""On a GPU: decode steps replayed from CUDA graphs give what eager steps give.

A bf16 model with head_dim 64 on the triton backend, graphs up to batch 16 (sizes 1, 2, 4, 8,
16). Requests join and leave between steps, so decode batches pass through captured sizes,
padded ones (3 -> 4, 9 -> 16, ...) and sizes past 16 (eager). Graph and eager runs differ in
rounding only (a padded batch can take other GEMM kernels and another split count), so greedy
tokens are compared under the engine issue's top-2-gap rule, as in test_engine_backends_gpu.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from app.engine import Engine
from app.engine.forward_batch import ForwardMode
from app.engine.make_checkpoint import ModelSpec, make_checkpoint
from app.engine.request import Request
from app.ipc.messages import SamplingParams
from engine_checks import assert_pool_clean
from test_cuda_graph_plan import Join, assert_same_greedy, decode_step_inputs, run_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = 0.1  # log-probability units: bf16 logits of unit scale differ by a few 1e-2
MAX_BS = 16
SPEC = ModelSpec(num_layers=2, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2, head_dim=64,
                 vocab_size=1024, max_position_embeddings=1024, rope_theta=10_000.0, dtype="bfloat16", seed=7,
                 init_std=0.06)
# 3 requests, then 6 more (9: padded to 16), then 9 more (18: eager); they leave one by one.
SCRIPT = [Join(0, 3 + 7 * i, 4 + i) for i in range(3)] + [Join(2, 40 + 11 * i, 8 + 2 * i) for i in range(6)] + [
    Join(6, 17 + 13 * i, 6 + 3 * i) for i in range(9)
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("cuda-graph") / "model", SPEC)


def _engine(path, options: str = "", **changes) -> Engine:
    """The engine of these tests, no overlap, with kernel ``options`` added and flags changed."""
    return Engine(str(path), device="cuda", dtype="bfloat16", attention_backend="triton", max_total_tokens=8192,
                  kernel_options=",".join(filter(None, ("overlap-schedule=off", options))),
                  chunked_prefill_size=64, cuda_graph_max_bs=MAX_BS, **changes)


@pytest.fixture(scope="module")
def graphed(checkpoint):
    return _engine(checkpoint)


@pytest.fixture(scope="module")
def eager(checkpoint):
    return _engine(checkpoint, disable_cuda_graph=True)


def test_flashinfer_prefill_with_triton_decode_graphs_equal_eager(checkpoint, eager):
    """--attention-backend flashinfer --decode-attention-backend triton: flashinfer's prefill,
    our decode kernels in the graphs, one pool; the eager triton engine's greedy tokens through
    joins and leaves."""
    from app.engine.attention.flashinfer_backend import flashinfer_available

    if not flashinfer_available(torch.device("cuda"), torch.bfloat16, SPEC.head_dim):
        pytest.skip("flashinfer is not installed here")
    hybrid = Engine(str(checkpoint), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                    decode_attention_backend="triton", max_total_tokens=8192, kernel_options="overlap-schedule=off",
                    chunked_prefill_size=64, cuda_graph_max_bs=MAX_BS)
    assert hybrid.built.plan.attention == ("flashinfer", "triton")
    assert hybrid.built.cuda_graph_batch_sizes == (1, 2, 4, 8, 16)
    compared = assert_same_greedy(run_script(eager, SCRIPT), run_script(hybrid, SCRIPT), TOL)
    assert compared >= len(SCRIPT) and hybrid.scheduler.runner.cuda_graphs.replays
    assert_pool_clean(hybrid)


def test_graphs_with_the_split_merge_in_stage1_equal_eager(checkpoint, eager):
    """fused-split-reduce inside the captured graphs (one counter buffer for all of them, left
    zero by every replay): the eager engine's greedy tokens through joins and leaves."""
    fused = _engine(checkpoint, "fused-split-reduce=on")
    assert fused.built.plan.fused_split_reduce and fused.scheduler.runner.attn_backend.reduce_in_stage1
    compared = assert_same_greedy(run_script(eager, SCRIPT), run_script(fused, SCRIPT), TOL)
    assert compared >= len(SCRIPT) and fused.scheduler.runner.cuda_graphs.replays
    assert not fused.scheduler.runner.attn_backend._split_counters.any()
    assert_pool_clean(fused)


def test_graphs_with_the_fused_mlp_equal_eager(checkpoint, eager):
    """fused-mlp with graphs of several sizes: the down weights are stored transposed before
    the first capture, so every graph (captured largest first) reads the weights the batch-1
    one uses (11-30: the batch-1 warm-up transposed them after the bigger graphs had recorded
    the old storage, freed by then: NaN logits). The eager engine's greedy tokens through joins
    and leaves."""
    fused = _engine(checkpoint, "fused-mlp=on")
    model = fused.scheduler.runner.model
    assert fused.built.plan.fused_mlp and model.fused_decode.down_transposed
    assert all(layer.mlp.down_proj.weight.t().is_contiguous() for layer in model.layers)
    compared = assert_same_greedy(run_script(eager, SCRIPT), run_script(fused, SCRIPT), TOL)
    assert compared >= len(SCRIPT) and 1 in fused.scheduler.runner.cuda_graphs.replays
    assert len(fused.scheduler.runner.cuda_graphs.replays) > 1  # graphs of more rows too
    assert_pool_clean(fused)


def test_graphs_are_captured_only_when_enabled(graphed, eager):
    assert graphed.built.cuda_graph_batch_sizes == (1, 2, 4, 8, 16)
    assert sorted(graphed.scheduler.runner.cuda_graphs.graphs) == [1, 2, 4, 8, 16]
    assert eager.built.cuda_graph_batch_sizes == () and eager.scheduler.runner.cuda_graphs is None


def test_greedy_tokens_with_graphs_equal_eager_through_joins_and_leaves(graphed, eager):
    expected, got = run_script(eager, SCRIPT), run_script(graphed, SCRIPT)
    compared = assert_same_greedy(expected, got, TOL)
    print(f"{compared} positions compared; decode batch sizes {got.decode_sizes}")
    assert compared >= len(SCRIPT)
    sizes = set(got.decode_sizes)
    assert max(sizes) > MAX_BS  # eager steps past the largest graph
    replays = graphed.scheduler.runner.cuda_graphs.replays
    assert {b for b in sizes if b <= MAX_BS} <= set(replays)  # every smaller decode step replayed a graph
    assert set(replays) & {1, 2, 4, 8, 16} and set(replays) - {1, 2, 4, 8, 16}  # exact and padded sizes
    for engine in (graphed, eager):
        assert_pool_clean(engine)


@pytest.mark.parametrize("num_seqs", [5, 8])
def test_replayed_logits_match_eager_within_bf16(graphed, num_seqs):
    scheduler, runner = graphed.scheduler, graphed.scheduler.runner
    rng = random.Random(num_seqs)
    params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(SPEC.vocab_size) for _ in range(5 + 37 * i)]
        scheduler.add_request(Request(f"logits-{num_seqs}-{i}", prompt, params, 0))
    while scheduler.waiting or scheduler.prefilling is not None:
        scheduler.step()
    for _ in range(3):  # a few ordinary (replayed) decode steps first
        scheduler.step()
    rows, prefix_lens, ids = decode_step_inputs(graphed)
    slots = scheduler.memory.alloc(len(rows))
    replayed = runner.forward(ForwardMode.DECODE, rows, prefix_lens, [1] * num_seqs, ids, slots).clone()
    eager = runner.forward_eager(ForwardMode.DECODE, rows, prefix_lens, [1] * num_seqs, ids, slots)
    assert replayed.shape == eager.shape == (num_seqs, SPEC.vocab_size)
    assert torch.isfinite(replayed).all()
    rel = ((replayed - eager).norm() / eager.norm()).item()
    assert rel < 1e-2, rel
    top2 = eager.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > TOL
    assert torch.equal(replayed.argmax(-1)[clear], eager.argmax(-1)[clear])
    pool = scheduler.memory.pool
    assert all(torch.isfinite(pool.k[i][0]).all() and torch.isfinite(pool.v[i][0]).all() for i in range(SPEC.num_layers))
    scheduler.memory.allocator.free(slots)
    scheduler.abort(None)
    scheduler.step()  # hands out the aborted requests' final outputs
    assert_pool_clean(graphed)
