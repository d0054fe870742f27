"""Where the host's time goes in one short request (its prefill and first tokens): the time to first
token that a batch-1 run pays once per request, outside the decode steps' CUDA graphs.

    python lab/tools/profile_request.py [--model-path DIR] [--input-len 128] [--output-len 1]
                                    [--repeats 20] [--rows 40] [--[no-]<engine switch>]...

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
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for app

from app.engine.step_results import StepTiming  # noqa: E402
from one_request import add_request_options, build_engine, request_runner  # noqa: E402  (lab/tools/, this script's folder, is on sys.path)


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
