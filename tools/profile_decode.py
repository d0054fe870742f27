"""Where a decode step's host time goes: torch.profiler over N steady-state decode steps.

    python tools/profile_decode.py [--model-path DIR] [--batch-size 256] [--input-len 512]
                                   [--steps 20] [--trace PATH] [--sort host|device]
                                   [<engine flag>]...   (the server's engine flags: --device,
                                   --attention-backend, --kernel-options KEY=VALUE,..., ...)

Admits ``--batch-size`` requests of random prompts (ignore_eos), steps until all of them decode
and a few warm-up steps have passed, then profiles ``--steps`` calls of ``Scheduler.step()``.
Prints the operators and CUDA runtime calls that take the most host time (a call that blocks
the host while a step runs on the device, such as a synchronising copy, shows up here with a
large self time) and, last, one JSON object: wall ms per step and the host ms per step spent in
each kind of CUDA runtime call. ``--trace`` also writes a Chrome trace.

``--phase prefill`` profiles the steps that take the prompts in instead (with a warm-up batch
first, so that compilation stays out). ``--sort device`` orders the table by device time instead (the kernels of a graph replay count
one by one), and the JSON line adds the device time per step and its largest kernels: where a
batch-1 step's time goes beyond the weight reads.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from app.engine import Engine  # noqa: E402
from app.engine.config import EngineConfig  # noqa: E402
from app.engine.request import Request, Status  # noqa: E402
from app.flags import add_flags, flag_values  # noqa: E402
from app.ipc.messages import SamplingParams  # noqa: E402

WARMUP_STEPS = 5
# CUDA runtime / driver calls worth a line of their own (matched as substrings of event names).
RUNTIME_CALLS = ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
                 "cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cudaHostAlloc", "cudaEventRecord",
                 "cudaEventQuery", "cudaMalloc")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    # every engine flag but the running-request limit, which is --batch-size
    add_flags(parser.add_argument_group("engine"), EngineConfig, skip=("max_running_requests",))
    parser.add_argument("--trace", default=None, help="also write a Chrome trace here")
    parser.add_argument("--rows", type=int, default=25, help="lines of the operator table")
    parser.add_argument("--sort", choices=("host", "device"), default="host",
                        help="order the table by host time (default) or by device time")
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                        help="profile steady decode steps (default) or every prefill step of the batch")
    options = parser.parse_args()
    if options.batch_size < 1 or options.steps < 1 or options.input_len < 1:
        parser.error("--batch-size, --steps and --input-len must be at least 1")

    engine = Engine(options.model_path, **flag_values(options, EngineConfig), max_running_requests=options.batch_size)
    scheduler = engine.scheduler
    vocab = engine.built.model_config.vocab_size
    rng = random.Random(0)
    budget = WARMUP_STEPS + options.steps + 8
    params = SamplingParams(max_new_tokens=budget, temperature=0.0, ignore_eos=True)
    requests = [Request(f"profile-{i}", [rng.randrange(vocab) for _ in range(options.input_len)], params, seed=i)
                for i in range(options.batch_size)]
    prefill = options.phase == "prefill"
    if prefill:  # compile and warm the prefill path on other prompts first
        warm = [[rng.randrange(vocab) for _ in range(options.input_len)] for _ in range(2)]
        engine.generate(input_ids=warm, sampling_params=SamplingParams(max_new_tokens=2, ignore_eos=True))
    for req in requests:
        scheduler.add_request(req)
    if not prefill:
        while scheduler.waiting or scheduler.prefilling is not None:
            scheduler.step()
        for _ in range(WARMUP_STEPS):
            scheduler.step()
        if any(r.status is not Status.RUNNING for r in requests):
            raise SystemExit("not every request is decoding: lower --batch-size or raise --max-total-tokens")

    cuda = engine.built.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        if prefill:  # every step until the last prompt is in (its decode steps come along)
            options.steps = 0
            while scheduler.waiting or scheduler.prefilling is not None:
                scheduler.step()
                options.steps += 1
        for _ in range(0 if prefill else options.steps):
            scheduler.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    scheduler.abort(None)
    while scheduler.has_work():
        scheduler.step()

    averages = prof.key_averages()
    sort_key = "self_cpu_time_total" if options.sort == "host" else "self_device_time_total"
    print(averages.table(sort_by=sort_key, row_limit=options.rows))
    kernels = device_kernels(averages, options.steps)
    runtime_ms: dict[str, float] = defaultdict(float)
    for event in averages:
        for name in RUNTIME_CALLS:
            if name in event.key:
                runtime_ms[name] += event.self_cpu_time_total / 1000.0 / options.steps
    if options.trace:
        prof.export_chrome_trace(options.trace)
    print(json.dumps({
        "device": str(engine.built.device),
        "kernel_plan": engine.built.plan.as_dict(),
        "decode_tiling": engine.built.decode_tiling,
        "batch_size": options.batch_size,
        "phase": options.phase,
        "steps": options.steps,
        "ms_per_step": round(1000 * wall / options.steps, 3),
        "runtime_host_ms_per_step": {k: round(v, 4) for k, v in sorted(runtime_ms.items())},
        "device_ms_per_step": round(sum(ms for _, _, ms in kernels), 4),
        "kernels_per_step": round(sum(n for _, n, _ in kernels), 1),
        "top_kernels_ms_per_step": [[name[:80], round(n, 1), round(ms, 4)] for name, n, ms in kernels[:options.rows]],
        "step_timing": scheduler.timing.as_dict(),
    }))


def device_kernels(averages, steps: int) -> list[tuple[str, float, float]]:
    """(name, launches per step, device ms per step) of every kernel and device copy, largest
    first; operator rows (whose device time is their kernels') are left out."""
    rows = []
    for event in averages:
        device_us = getattr(event, "self_device_time_total", 0.0)
        if device_us <= 0 or event.key.startswith("aten::") or event.key.startswith("cuda"):
            continue
        rows.append((event.key, event.count / steps, device_us / 1000.0 / steps))
    return sorted(rows, key=lambda row: -row[2])


if __name__ == "__main__":
    main()
