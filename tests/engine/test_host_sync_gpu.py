"""On a GPU: a steady decode step makes no call that blocks the host until the device is idle.

Such a call (``.item()``, ``.tolist()`` of a device tensor, a copy from pageable memory, a
Python scalar assigned through an index tensor) costs nothing without overlap, where the device
is idle anyway when the host prepares a step, but with overlap it waits for the step in flight:
one such call in the KV allocator halved decode throughput at 256 requests on an H200. torch's
sync debug mode turns each of them into an error. Reading the step's tokens waits on an event
(not caught by the mode, and meant: it returns while the next step still runs).
"""

from __future__ import annotations

import pytest
import torch

from app.engine import Engine
from app.engine.kernel_plan import KernelOptions
from app.engine.make_checkpoint import ModelSpec, make_checkpoint
from app.engine.request import Request, Status
from app.ipc.messages import SamplingParams
from engine_checks import assert_pool_clean

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPEC = ModelSpec(num_layers=2, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2, head_dim=64,
                 vocab_size=1024, max_position_embeddings=1024, rope_theta=10_000.0, dtype="bfloat16", seed=5,
                 init_std=0.06)
BATCH = 12  # a padded graph size (16)
STEADY_STEPS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("host-sync") / "model", SPEC)


# Every sampling knob at once: temperature, the top-k/top-p/min-p filters, the three penalties,
# a logit bias and log-probabilities, so that each of their device paths runs in the window.
SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, frequency_penalty=0.3, presence_penalty=0.2,
               repetition_penalty=1.1, logit_bias=((5, 2.0), (9, -100.0)), logprobs=True, top_logprobs=2)


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("schedule", ["overlap", "overlap+copy-stream", "no-overlap"])
def test_steady_decode_steps_never_block_the_host(checkpoint, page_size: int, schedule: str, sampling: str) -> None:
    overlap = schedule != "no-overlap"
    engine = Engine(str(checkpoint), device="cuda", dtype="bfloat16", attention_backend="triton",
                    max_total_tokens=8192, page_size=page_size, cuda_graph_max_bs=16,
                    kernel_options=KernelOptions(overlap_schedule=overlap, copy_stream=schedule.endswith("copy-stream")))
    scheduler = engine.scheduler
    knobs = SAMPLED if sampling == "sampled" else dict(temperature=0.0)
    params = SamplingParams(max_new_tokens=STEADY_STEPS + 16, ignore_eos=True, **knobs)
    requests = [Request(f"sync-{i}", [(7 * i + 3 * j) % 1000 + 1 for j in range(20 + 5 * i)], params, seed=i)
                for i in range(BATCH)]
    for req in requests:
        scheduler.add_request(req)
    while scheduler.waiting or scheduler.prefilling is not None:
        scheduler.step()
    for _ in range(3):  # the first decode steps: the batch settles, overlap starts
        scheduler.step()
    assert all(r.status is Status.RUNNING for r in requests)
    overlapped = scheduler.timing.overlapped_steps
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(STEADY_STEPS):
            scheduler.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert scheduler.timing.overlapped_steps - overlapped == (STEADY_STEPS if overlap else 0)
    assert sum(scheduler.runner.cuda_graphs.replays.values()) >= STEADY_STEPS
    while scheduler.has_work():
        scheduler.step()
    assert all(len(r.output_ids) == params.max_new_tokens for r in requests)
    assert_pool_clean(engine)


@pytest.mark.parametrize("page_size", [1, 16])
def test_requests_finishing_while_steps_are_in_flight_never_block_the_host(checkpoint, page_size: int) -> None:
    """Requests that finish one after another during overlapped decode: their rows leave the
    next batch on the device and their KV goes back without a device read (the allocator's
    checks are deferred to when the scheduler is idle, which this window does not reach), with
    one slot a page and with pages of 16 (each request's last page cut short)."""
    engine = Engine(str(checkpoint), device="cuda", dtype="bfloat16", attention_backend="triton",
                    max_total_tokens=8192, page_size=page_size, cuda_graph_max_bs=16,
                    kernel_options="overlap-schedule=on")
    scheduler = engine.scheduler
    requests = [Request(f"leave-{i}", [(5 * i + 3 * j) % 1000 + 1 for j in range(16 + 3 * i)],
                        SamplingParams(max_new_tokens=8 + 2 * i, temperature=0.0, ignore_eos=True), seed=i)
                for i in range(BATCH)]
    for req in requests:
        scheduler.add_request(req)
    while scheduler.waiting or scheduler.prefilling is not None:
        scheduler.step()
    for _ in range(2):
        scheduler.step()
    overlapped = scheduler.timing.overlapped_steps
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2 * BATCH):  # all but the longest request finish in this window
            scheduler.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum(r.finish is not None for r in requests) >= BATCH // 2  # 10 of 12 on the CPU
    assert scheduler.timing.overlapped_steps - overlapped == 2 * BATCH
    while scheduler.has_work():
        scheduler.step()
    assert [len(r.output_ids) for r in requests] == [8 + 2 * i for i in range(BATCH)]
    assert_pool_clean(engine)
