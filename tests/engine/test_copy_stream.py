"""``copy-stream``: a step's sampled tokens go to the host on a side stream, by default only
for steps of at most COPY_STREAM_MAX_BATCH rows, with ``copy-stream=on`` for every step.

Only where the copies run changes, so the tokens, log-probabilities and alternatives must be
the same as without it, bit for bit, with overlap on and requests joining and leaving, and with
the default, whose steps move between the two streams as the batch shrinks past the limit
(that a steady decode step still never blocks the host is one of test_host_sync_gpu.py's
cases). Off CUDA the flag is refused, naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_checks import assert_pool_clean

from app.engine import Engine
from app.engine.kernel_plan import COPY_STREAM_EVERY_BATCH, COPY_STREAM_MAX_BATCH, KernelOptions, resolve_copy_stream
from app.engine.make_checkpoint import ModelSpec, make_checkpoint
from app.ipc.messages import SamplingParams
from app.server_args import parse_server_args

SPEC = ModelSpec(num_layers=2, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2, head_dim=64,
                 vocab_size=1024, max_position_embeddings=1024, rope_theta=10_000.0, dtype="bfloat16", seed=9,
                 init_std=0.06)


def test_copy_stream_is_on_with_cuda_for_small_batches_by_default_and_refused_off_cuda() -> None:
    cpu = torch.device("cpu")
    assert KernelOptions().copy_stream is None and parse_server_args([]).engine_config(".").options.copy_stream is None
    assert parse_server_args(["--kernel-options", "copy-stream=on"]).engine_config(".").options.copy_stream is True
    assert parse_server_args(["--kernel-options", "copy-stream=off"]).engine_config(".").options.copy_stream is False
    assert resolve_copy_stream(None, cpu) == 0 and resolve_copy_stream(False, cpu) == 0
    cuda = torch.device("cuda")  # resolving reads the device type only
    assert COPY_STREAM_MAX_BATCH == 48 and COPY_STREAM_EVERY_BATCH >= 1 << 20  # more rows than any batch
    assert resolve_copy_stream(None, cuda) == COPY_STREAM_MAX_BATCH
    assert resolve_copy_stream(True, cuda) == COPY_STREAM_EVERY_BATCH
    assert resolve_copy_stream(False, cuda) == 0
    with pytest.raises(ValueError, match="--kernel-options copy-stream=on needs a CUDA device; here: cpu"):
        resolve_copy_stream(True, cpu)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("copy-stream") / "model", SPEC)


def _params(i: int) -> SamplingParams:
    """Greedy and sampled rows, with log-probabilities and alternatives on some, of lengths that
    make requests leave at different steps."""
    sampled = dict(temperature=0.9, top_p=0.95, seed=100 + i) if i % 2 else dict(temperature=0.0)
    return SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True, logprobs=i % 3 == 0,
                          top_logprobs=2 if i % 3 == 0 else 0, **sampled)


# More requests than the default's limit, leaving at different steps: with the default, decode
# steps of more rows copy out on the current stream, and those after enough requests have left
# on the side stream.
REQUESTS = COPY_STREAM_MAX_BATCH + 4


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_outputs_are_the_same_with_the_copy_stream(checkpoint: Path, overlap: bool) -> None:
    prompts = [[(11 * i + 5 * j) % 1000 + 1 for j in range(9 + 4 * i)] for i in range(REQUESTS)]
    params = [_params(i) for i in range(REQUESTS)]
    results = []
    for copy_stream, max_rows in ((False, 0), (None, COPY_STREAM_MAX_BATCH), (True, COPY_STREAM_EVERY_BATCH)):
        # fused-mlp pinned off (whatever its default): its atomics make batch-1 steps' logprobs
        # differ in the last bits from run to run, whatever the copy stream does.
        options = KernelOptions(overlap_schedule=overlap, copy_stream=copy_stream, fused_mlp=False)
        engine = Engine(str(checkpoint), device="cuda", dtype="bfloat16", max_total_tokens=8192,
                        kernel_options=options, cuda_graph_max_bs=8)
        assert engine.built.plan.copy_stream == max_rows
        side_stream = engine.scheduler.copy_stream_for(1)
        assert (side_stream is None) == (max_rows == 0)
        assert engine.scheduler.copy_stream_for(COPY_STREAM_MAX_BATCH) is side_stream
        assert engine.scheduler.copy_stream_for(REQUESTS) is (side_stream if max_rows >= REQUESTS else None)
        results.append(engine.generate(input_ids=prompts, sampling_params=params))
        assert engine.scheduler.timing.device_s > 0  # the step timing reads the side stream's events
        assert_pool_clean(engine)
    plain, *sides = results
    for side in sides:
        for a, b, p in zip(plain, side, params, strict=True):
            assert a.token_ids == b.token_ids and len(b.token_ids) == p.max_new_tokens
            assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
