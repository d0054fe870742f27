"""Where the host's time goes in one short request (its prefill and first tokens): the time to first
token that a batch-1 run pays once per request, outside the decode steps' CUDA graphs.

    python lab/tools/profile_request.py [--model-path DIR] [--input-len 128] [--output-len 1]
                                        [--repeats 20] [--rows 40] [<engine flag>]...

Builds the Engine as tools/bench_offline.py does, warms the request's shape up, then times
``--repeats`` requests of one prompt each (random ids, greedy, EOS ignored) without a profiler
(the median and the spread, ms), then runs them again under cProfile and prints the functions
by cumulative and by own time (deterministic profiling inflates Python-heavy code, so read the
shares, not the milliseconds). The last line is one JSON object with the unprofiled figures and
the timed requests' step timing (the scheduler's StepTiming: wall time in its steps, the device's,
the host's waits).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root, for app

from app.engine import Engine  # noqa: E402
from app.engine.config import EngineConfig  # noqa: E402
from app.engine.step_results import StepTiming  # noqa: E402
from app.flags import add_flags, flag_values  # noqa: E402
from app.ipc.messages import SamplingParams  # noqa: E402


def add_request_options(parser: argparse.ArgumentParser, output_len: int) -> None:
    """The checkpoint, the request's shape and the engine's flags (``--output-len`` defaults
    to ``output_len``, ``--cuda-graph-max-bs`` to 1)."""
    parser.add_argument("--model-path", default=None, help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=output_len)
    add_flags(parser.add_argument_group("engine"), EngineConfig)
    parser.set_defaults(cuda_graph_max_bs=1)


def build_engine(options: argparse.Namespace) -> Engine:
    """A batch-1 Engine (graphs up to ``--cuda-graph-max-bs``) with the engine flags given."""
    return Engine(options.model_path, **flag_values(options, EngineConfig))


def request_runner(engine: Engine, options: argparse.Namespace) -> Callable[[], None]:
    """A function that serves one request of ``--input-len`` random tokens (a new prompt each
    call, from a fixed seed) and ``--output-len`` output tokens (greedy, EOS ignored), then flushes
    the prefix cache, so that every prompt is a full prefill as in the batch-1 bench."""
    vocab = engine.built.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=options.output_len, temperature=0.0, ignore_eos=True)

    def request() -> None:
        prompt = [rng.randrange(vocab) for _ in range(options.input_len)]
        engine.generate(input_ids=[prompt], sampling_params=params)
        engine.scheduler.memory.flush_cache()

    return request




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_request_options(parser, output_len=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rows", type=int, default=40)
    options = parser.parse_args()

    engine = build_engine(options)
    request = request_runner(engine, options)

    for _ in range(3):  # triton's specialisations and the allocator's blocks for this shape
        request()
    times = []
    engine.scheduler.timing = StepTiming()  # the timed requests' steps only
    for _ in range(options.repeats):
        start = time.perf_counter()
        request()
        times.append(1e3 * (time.perf_counter() - start))
    timing = engine.scheduler.timing.as_dict()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(options.repeats):
        request()
    profiler.disable()
    stats = pstats.Stats(profiler).strip_dirs()
    for order in ("cumulative", "tottime"):
        print(f"=== by {order} time, {options.repeats} requests")
        stats.sort_stats(order).print_stats(options.rows)
    print(json.dumps({"input_len": options.input_len, "output_len": options.output_len, "repeats": options.repeats,
                      "ms_median": round(statistics.median(times), 3), "ms_min": round(min(times), 3),
                      "ms_max": round(max(times), 3), "step_timing": timing}))


if __name__ == "__main__":
    main()
