"""Batch-1 requests after one change to the CUDA streams used at start-up: the probe that found
a second pool stream slowing every later decode step (docs/gpu_notes.md, variant 95).

    python lab/tools/bench_start_streams.py MODE [--model-path DIR] [--input-len 128] [--output-len 1024]
                                        [--requests 5] [--[no-]<engine switch>]...

MODE, applied after the Engine is built and before its first request (but one, applied before):
  plain         nothing (the reference);
  extra-stream  one more stream of torch's pool runs a kernel;
  extra-high-priority  the same on a stream of the high-priority pool (whether the pool or the
                priority matters: variant 97 left the mechanism open);
  extra-before-build  as extra-stream, but before the Engine is built (so before its graphs are captured
                and its own side streams made): whether a stream first used after the capture
                is what costs;
  extra-copy    one more stream of torch's pool copies host memory to the device, no kernel:
                whether only streams that ran kernels cost;
  extra-graph   one more CUDA graph (a matmul) is captured on a stream of its own;
  copy-on-capture  the scheduler copies its samples out on the graphs' capture stream instead of
                its own (one stream fewer in use);
  compute-on-capture  every step runs on the graphs' capture stream instead of the default stream
                (the default stream idle from the first request on).
What each found: docs/gpu_notes.md, variants 95, 97 and 100 (only a stream that ran a kernel
costs, at the graph's plain kernel boundaries; the engine's own layout pays none of it).

Each MODE runs in a fresh process (run the modes one after another, alternated, and compare
within a call). Three warm-up requests, then ``--requests`` timed requests of one random
prompt each (greedy, EOS ignored, the prefix cache flushed after each). The one output line is
a JSON object: the requests' milliseconds, their median, and the scheduler's step timing (its
``device_s`` is the device time from each step's start event to its results).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for app

from app.engine import Engine  # noqa: E402
from app.engine.step_results import StepTiming  # noqa: E402
from one_request import add_request_options, build_engine, request_runner  # noqa: E402  (lab/tools/, this script's folder, is on sys.path)

MODES = ("plain", "extra-stream", "extra-before-build", "extra-copy", "extra-high-priority", "extra-graph",
         "copy-on-capture", "compute-on-capture")


def run_on_side_stream(device: torch.device, priority: int = 0) -> tuple[torch.cuda.Stream, torch.Tensor]:
    """One kernel on a new stream of torch's pool (``priority`` 0 the default pool, negative
    numbers higher, clamped to the device's range), waited for. Returns the stream and the tensor
    it wrote."""
    a = torch.randn(512, 2048, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream(device, priority=priority)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        a.add_(1)
    side.synchronize()
    return side, a


def build_with_streams(mode: str, device: str, build: Callable[[], Engine]) -> Engine:
    """The Engine that ``build`` makes, with ``mode`` (see the module's docstring) applied around
    its build: before it for extra-before-build, after it otherwise. ``device`` as the Engine's
    argument."""
    if mode == "extra-before-build":
        if not torch.cuda.is_available() or (device != "auto" and not device.startswith("cuda")):
            raise SystemExit(f"{mode} needs a CUDA device")
        run_on_side_stream(torch.device("cuda" if device == "auto" else device))
        return build()
    engine = build()
    _perturb_built(engine, mode)
    return engine


def _perturb_built(engine: Engine, mode: str) -> None:
    """Apply ``mode``, any but extra-before-build, to a freshly built engine."""
    device = engine.built.device
    if mode == "plain":
        return
    if device.type != "cuda":
        raise SystemExit(f"{mode} needs a CUDA device")
    if mode == "copy-on-capture":
        scheduler = engine.scheduler
        if scheduler.copy_stream_max_rows == 0:
            raise SystemExit("copy-on-capture: this engine copies no step on a side stream (--copy-stream is off)")
        scheduler._copy_stream = scheduler.runner.capture_stream()
        return
    if mode == "extra-copy":
        side = torch.cuda.Stream(device)
        host = torch.randn(512, 2048).pin_memory()
        with torch.cuda.stream(side):
            host.to(device, non_blocking=True)
        side.synchronize()
        return
    if mode == "compute-on-capture":
        stream = engine.scheduler.runner.capture_stream()
        stream.wait_stream(torch.cuda.current_stream(device))
        torch.cuda.set_stream(stream)  # this thread's current stream for the rest of the run
        return
    side, a = run_on_side_stream(device, priority=-1 if mode == "extra-high-priority" else 0)
    if mode == "extra-graph":
        b = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
        with torch.cuda.stream(side):
            a @ b  # cuBLAS's workspace, before the capture
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            a @ b
        graph.replay()
    torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=MODES)
    add_request_options(parser, output_len=1024)
    parser.add_argument("--requests", type=int, default=5)
    options = parser.parse_args()
    if options.requests < 1:
        parser.error("--requests must be at least 1")

    engine = build_with_streams(options.mode, options.device, lambda: build_engine(options))
    request = request_runner(engine, options)

    for _ in range(3):
        request()
    engine.scheduler.timing = StepTiming()
    times = []
    for _ in range(options.requests):
        started = time.perf_counter()
        request()
        times.append(1e3 * (time.perf_counter() - started))
    print(json.dumps({"mode": options.mode, "ms": [round(t, 2) for t in times],
                      "ms_median": round(statistics.median(times), 2),
                      "prefill_graph_tokens": list(engine.built.prefill_graph_tokens),
                      "step_timing": engine.scheduler.timing.as_dict()}))


if __name__ == "__main__":
    main()
