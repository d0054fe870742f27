"""On a GPU: the flashinfer backend's decode steps replayed from CUDA graphs give what its eager
steps give.

bf16 models in two shapes, one per flashinfer decode path: GQA group 4 with head_dim 64 (the
tensor-core path, ``use_tensor_cores=True``) and group 2 with head_dim 128 (the CUDA-core decode
kernel). Graphs up to batch 16 (sizes 1, 2, 4, 8, 16); requests join and leave between steps, so
decode batches pass through captured sizes, padded ones (3 -> 4, 9 -> 16, ...) and sizes past 16
(eager). Graph and eager runs differ in rounding only (a graph plans flashinfer's split-KV
schedule for its fixed batch size, and a padded batch can take other GEMM kernels), so greedy
tokens are compared under the engine issue's top-2-gap rule, as in test_cuda_graph_gpu.py.
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
SIZES = (1, 2, 4, 8, 16)
SPECS = {
    "gqa4-d64-tensor-cores": ModelSpec(num_layers=2, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2,
                                       head_dim=64, vocab_size=1024, max_position_embeddings=1024, rope_theta=10_000.0,
                                       dtype="bfloat16", seed=7, init_std=0.06),
    "gqa2-d128-cuda-cores": ModelSpec(num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                                      head_dim=128, vocab_size=1024, max_position_embeddings=1024, rope_theta=10_000.0,
                                      dtype="bfloat16", seed=9, init_std=0.06),
}
# 3 requests, then 6 more (9: padded to 16), then 9 more (18: eager); they leave one by one.
SCRIPT = [Join(0, 3 + 7 * i, 4 + i) for i in range(3)] + [Join(2, 40 + 11 * i, 8 + 2 * i) for i in range(6)] + [
    Join(6, 17 + 13 * i, 6 + 3 * i) for i in range(9)
]


def _engine(path, **changes) -> Engine:
    return Engine(str(path), device="cuda", dtype="bfloat16", attention_backend="flashinfer", max_total_tokens=8192, kernel_options="overlap-schedule=off",
                  chunked_prefill_size=64, cuda_graph_max_bs=MAX_BS, **changes)


@pytest.fixture(scope="module", params=sorted(SPECS))
def engines(request, tmp_path_factory):
    """(graphed, eager) flashinfer engines over one checkpoint of each shape."""
    from app.engine.attention.flashinfer_backend import flashinfer_available

    spec = SPECS[request.param]
    if not flashinfer_available(torch.device("cuda"), torch.bfloat16, spec.head_dim):
        pytest.skip("flashinfer is not installed here")
    path = make_checkpoint(tmp_path_factory.mktemp(request.param) / "model", spec)
    return _engine(path), _engine(path, disable_cuda_graph=True)


def test_flashinfer_graphs_are_captured_one_wrapper_per_size(engines):
    graphed, eager = engines
    assert graphed.built.plan.attention.prefill == "flashinfer"
    assert graphed.built.cuda_graph_batch_sizes == SIZES
    runner = graphed.scheduler.runner
    assert sorted(runner.cuda_graphs.graphs) == list(SIZES)
    backend = runner.attn_backend
    assert sorted(backend._graph_wrappers) == list(SIZES)
    assert all(w.is_cuda_graph_enabled for w in backend._graph_wrappers.values())
    group = graphed.built.model_config.num_heads // graphed.built.model_config.num_kv_heads
    assert all(w.use_tensor_cores == (group >= 4) for w in backend._graph_wrappers.values())
    assert eager.built.cuda_graph_batch_sizes == () and eager.scheduler.runner.cuda_graphs is None


def test_flashinfer_greedy_tokens_with_graphs_equal_eager_through_joins_and_leaves(engines):
    graphed, eager = engines
    expected, got = run_script(eager, SCRIPT), run_script(graphed, SCRIPT)
    compared = assert_same_greedy(expected, got, TOL)
    print(f"{compared} positions compared; decode batch sizes {got.decode_sizes}")
    assert compared >= len(SCRIPT)
    sizes = set(got.decode_sizes)
    assert max(sizes) > MAX_BS  # eager steps past the largest graph
    replays = graphed.scheduler.runner.cuda_graphs.replays
    assert {b for b in sizes if b <= MAX_BS} <= set(replays)  # every smaller decode step replayed a graph
    assert set(replays) & set(SIZES) and set(replays) - set(SIZES)  # exact and padded sizes
    for engine in (graphed, eager):
        assert_pool_clean(engine)


@pytest.mark.parametrize("num_seqs", [5, 8])
def test_flashinfer_replayed_logits_match_eager_within_bf16(engines, num_seqs):
    graphed, _ = engines
    scheduler, runner = graphed.scheduler, graphed.scheduler.runner
    vocab = graphed.built.model_config.vocab_size
    rng = random.Random(num_seqs)
    params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    prompts = [[rng.randrange(vocab) for _ in range(5 + 37 * i)] for i in range(num_seqs - 1)]
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"fi-logits-{num_seqs}-{i}", prompt, params, 0))
    while scheduler.waiting or scheduler.prefilling is not None:
        scheduler.step()
    # The longest prompt again, once its prefill chunks are in the radix cache: both rows point
    # at the same slots, so a step's page table holds those slots twice.
    scheduler.add_request(Request(f"fi-logits-{num_seqs}-again", list(prompts[-1]), params, 0))
    while scheduler.waiting or scheduler.prefilling is not None:
        scheduler.step()
    table = scheduler.memory.table.req_to_token
    by_rid = {r.rid: r for r in scheduler.running}
    first, again = by_rid[f"fi-logits-{num_seqs}-{num_seqs - 2}"].row, by_rid[f"fi-logits-{num_seqs}-again"].row
    assert torch.equal(table[first, :32], table[again, :32])  # its cached chunks: 52 tokens at least
    for _ in range(3):  # a few ordinary (replayed) decode steps first
        scheduler.step()
    rows, prefix_lens, ids = decode_step_inputs(graphed)
    slots = scheduler.memory.alloc(len(rows))
    before = dict(runner.cuda_graphs.replays)
    replayed = runner.forward(ForwardMode.DECODE, rows, prefix_lens, [1] * num_seqs, ids, slots).clone()
    assert runner.cuda_graphs.replays[num_seqs] == before.get(num_seqs, 0) + 1  # it did replay (5: padded to 8)
    eager = runner.forward_eager(ForwardMode.DECODE, rows, prefix_lens, [1] * num_seqs, ids, slots)
    assert replayed.shape == eager.shape == (num_seqs, vocab)
    assert torch.isfinite(replayed).all()
    rel = ((replayed - eager).norm() / eager.norm()).item()
    assert rel < 1e-2, rel
    top2 = eager.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > TOL
    assert torch.equal(replayed.argmax(-1)[clear], eager.argmax(-1)[clear])
    pool = scheduler.memory.pool
    assert all(torch.isfinite(pool.k[i][0]).all() and torch.isfinite(pool.v[i][0]).all()
               for i in range(len(pool.k)))
    scheduler.memory.allocator.free(slots)
    scheduler.abort(None)
    scheduler.step()  # hands out the aborted requests' final outputs
    assert_pool_clean(graphed)
