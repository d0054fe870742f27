"""Prefill graphs (app/engine/prefill_graph.py, ``prefill-graph-max-tokens``): the token counts
captured and the flag's checks; the padded static step run eagerly (on a CPU under triton's
interpreter, or on the GPU) against the engine's own eager prefill after a cached prefix: the same
logits, the same K/V in the new slots and the same request-table entries, and nothing written
anywhere else but the dummy slot; on a GPU the captured graphs through the engine, against an
engine without them (greedy tokens, prompts within, at and past the largest count, a prefix
from the radix cache), with every KV slot free after a cache flush."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.engine import Engine
from app.engine.config import EngineConfig
from app.engine.cuda_graph import DUMMY_SLOT
from app.engine.forward_batch import ForwardMode
from app.engine.kernel_plan import resolve_prefill_graph_max_tokens
from app.engine.make_checkpoint import ModelSpec, make_checkpoint
from app.engine.prefill_graph import PrefillGraphRunner, graph_token_count, prefill_graph_tokens
from app.server_args import parse_server_args

SPEC = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                 vocab_size=1024, max_position_embeddings=512, rope_theta=10_000.0, dtype="float32", init_std=0.12,
                 seed=31)


def test_the_token_counts_double_up_to_the_flag() -> None:
    assert prefill_graph_tokens(0) == ()
    assert prefill_graph_tokens(16) == (16,)
    assert prefill_graph_tokens(512) == (16, 32, 64, 128, 256, 512)
    assert prefill_graph_tokens(100) == (16, 32, 64, 100)
    with pytest.raises(ValueError, match="prefill-graph-max-tokens must be 0 \\(off\\) or at least 16, got 8"):
        prefill_graph_tokens(8)
    counts = (16, 32, 64)
    assert [graph_token_count(counts, n) for n in (2, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, None]


def test_the_option_parses_and_is_checked(tmp_path: Path) -> None:
    args = parse_server_args(["--model-path", str(tmp_path), "--kernel-options", "prefill-graph-max-tokens=256"])
    assert args.engine_config(str(tmp_path)).options.prefill_graph_max_tokens == 256
    with pytest.raises(ValueError, match="prefill-graph-max-tokens takes auto or 0 \\(off\\) or a whole number "
                                         "from 16, got 15"):
        EngineConfig(model_path="m", kernel_options="prefill-graph-max-tokens=15").validate()
    # Where graphs cannot run: off by default, an error when asked for; where they can, up to 512 by default.
    assert resolve_prefill_graph_max_tokens(None, "triton", decode_graphs=False) == 0
    assert resolve_prefill_graph_max_tokens(None, "flashinfer", decode_graphs=True) == 0
    assert resolve_prefill_graph_max_tokens(None, "triton", decode_graphs=True) == 512
    assert prefill_graph_tokens(512) == (16, 32, 64, 128, 256, 512)
    assert resolve_prefill_graph_max_tokens(100, "triton", decode_graphs=True) == 100
    assert prefill_graph_tokens(100) == (16, 32, 64, 100)
    assert resolve_prefill_graph_max_tokens(0, "triton", decode_graphs=True) == 0 and prefill_graph_tokens(0) == ()
    with pytest.raises(ValueError, match="prefill-graph-max-tokens=64 needs CUDA graphs .* the torch backend"):
        resolve_prefill_graph_max_tokens(64, "torch", True)


def _kv(engine: Engine) -> list[torch.Tensor]:
    pool = engine.scheduler.memory.pool
    return [t.clone() for t in (*pool.k, *pool.v)]


# The padded rows' attention output is never stored (app/engine/prefill_graph.py): the next
# norm squares and sums whatever the buffer held, which can overflow in the interpreter's numpy.
# Those rows reach no real one, which the test checks value by value.
@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")
def test_a_padded_static_step_equals_the_eager_prefill(tmp_path: Path, device: torch.device) -> None:
    """The graphs' static step (capture_stream=None: the same buffers and launches, run eagerly) after
    a 9-token prefix, for 5, 16 and 23 new tokens (padded to 16, exactly 16, padded to 32)."""
    checkpoint = make_checkpoint(tmp_path / "model", SPEC)
    engine = Engine(str(checkpoint), device=device.type, max_total_tokens=256, max_running_requests=2,
                    attention_backend="triton", kernel_options="fused-kernels=on", disable_cuda_graph=True)
    runner = engine.scheduler.runner
    assert runner.prefill_graphs is None and engine.built.prefill_graph_tokens == ()
    static = PrefillGraphRunner(runner.model, runner.attn_backend, runner.table, (16, 32), capture_stream=None)
    row, prefix = 1, 9
    gen = torch.Generator().manual_seed(5)
    prefix_ids = torch.randint(0, SPEC.vocab_size, (prefix,), generator=gen).tolist()
    runner.forward_eager(ForwardMode.EXTEND, [row], [0], [prefix], prefix_ids,
                         torch.arange(10, 10 + prefix, device=device))
    for n in (5, 16, 23):
        ids = torch.randint(0, SPEC.vocab_size, (n,), generator=gen).tolist()
        slots = torch.arange(40, 40 + n, device=device)
        eager = runner.forward_eager(ForwardMode.EXTEND, [row], [prefix], [n], ids, slots).float()
        before = _kv(engine)
        runner.table.req_to_token[row, prefix:prefix + n] = 0
        got = static.replay(row, prefix, ids, slots).float()
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
        assert runner.table.req_to_token[row, prefix:prefix + n].tolist() == slots.tolist()
        for after, old in zip(_kv(engine), before):
            # The new slots got the eager step's K/V again (up to the padded GEMMs' rounding);
            # only the dummy slot took the padding's, every other slot is as it was.
            torch.testing.assert_close(after[slots], old[slots], rtol=1e-5, atol=1e-5)
            keep = torch.ones(after.shape[0], dtype=torch.bool, device=device)
            keep[DUMMY_SLOT] = False
            keep[slots] = False
            assert torch.equal(after[keep], old[keep])
    assert static.replays == {16: 2, 32: 1}


@pytest.mark.gpu
def test_bf16_engine_greedy_tokens_with_prefill_graphs(tmp_path: Path, device: torch.device) -> None:
    """Captured graphs (16 .. 64 tokens) through the engine against one without them: greedy
    tokens equal wherever the reference's top-2 gap is clear, for prompts within, at and past
    the largest count and a prompt that shares a cached prefix; then the pool is free again."""
    from test_fused_model import WIDE_BATCH1_ENGINE, assert_batch1_greedy_tokens_equal, wide_bf16_spec

    checkpoint = make_checkpoint(tmp_path / "model", wide_bf16_spec(num_layers=3, seed=41))
    reference = Engine(str(checkpoint), kernel_options="prefill-graph-max-tokens=0", **WIDE_BATCH1_ENGINE)
    graphed = Engine(str(checkpoint), kernel_options="prefill-graph-max-tokens=64", **WIDE_BATCH1_ENGINE)
    assert reference.built.prefill_graph_tokens == () and graphed.built.prefill_graph_tokens == (16, 32, 64)
    # Both kinds of graph were captured on the one side stream (a second one slows every decode step).
    runner = graphed.scheduler.runner
    assert runner.cuda_graphs is not None and runner.prefill_graphs is not None
    assert runner.cuda_graphs.capture_stream is runner.prefill_graphs.capture_stream is runner.capture_stream()
    prompts = [[(37 * i + 11 * n) % 1024 for i in range(n)] for n in (3, 16, 23, 64, 90)]
    prompts.append(prompts[-1][:70] + [5, 6, 7])  # 70 tokens from the cache, then 3 new
    assert_batch1_greedy_tokens_equal(reference, graphed, prompts)
    served = graphed.scheduler.runner.prefill_graphs
    assert served is not None and served.replays[16] >= 2 and served.replays[32] >= 1 and served.replays[64] >= 1
    usage = graphed.scheduler.stats().usage
    assert usage.consistent and usage.used == 0 and usage.locked == 0, usage
    assert graphed.scheduler.memory.flush_cache()
    usage = graphed.scheduler.stats().usage
    assert usage.free == usage.total, usage
