"""What the crash dump's request history costs: per request on the hot path, and per dump.

    python tools/bench_request_history.py [--requests 200000] [--prompt 512] [--output 128]

The scheduler tells its RequestHistory (app/observability/request_history.py) of each
request's first token and end. This times those two calls per request, with the history full
(so every end also trims the oldest entry), against the same events told to no observer; then
the time to build and write a dump with a full history (4,096 requests, inputs at
``--log-requests-level`` 2 and 3), which must stay well under a second. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.request import Request  # noqa: E402
from app.engine.scheduling.events import SchedulerEvents  # noqa: E402
from app.ipc.messages import SamplingParams  # noqa: E402
from app.observability.crash_dump import write_crash_dump  # noqa: E402
from app.observability.request_history import HISTORY_MAX_REQUESTS, RequestHistory  # noqa: E402


def _requests(count: int, prompt: int, output: int) -> list[Request]:
    params = SamplingParams(max_new_tokens=output)
    ids = list(range(1000, 1000 + prompt))
    made = []
    for i in range(count):
        req = Request(f"r{i}", ids, params, i, arrival_time=float(i))
        req.output_ids = list(range(output))
        made.append(req)
    return made


def _per_request_ns(observer: SchedulerEvents, requests: list[Request]) -> float:
    started = time.perf_counter_ns()
    now = 1.0
    for req in requests:
        observer.first_token(req, now)
        observer.finished(req, now)
        now += 1e-4
    return (time.perf_counter_ns() - started) / len(requests)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens of each request")
    parser.add_argument("--output", type=int, default=128, help="output tokens of each request")
    options = parser.parse_args()
    requests = _requests(options.requests, options.prompt, options.output)
    baseline = min(_per_request_ns(SchedulerEvents(), requests) for _ in range(3))
    history_ns = min(_per_request_ns(RequestHistory(), requests) for _ in range(3))

    full = RequestHistory()
    _per_request_ns(full, requests[:HISTORY_MAX_REQUESTS])
    dumps = {}
    with tempfile.TemporaryDirectory() as folder:
        for level in (2, 3):
            started = time.perf_counter()
            dump = {"recent_requests": full.recent(2.0, level)}
            path = write_crash_dump(folder, dump, f"bench_{level}.json")
            dumps[f"level_{level}"] = {"seconds": round(time.perf_counter() - started, 3),
                                       "mib": round(path.stat().st_size / 2**20, 1),
                                       "requests": len(dump["recent_requests"])}
    print(json.dumps({
        "requests": options.requests, "prompt_tokens": options.prompt, "output_tokens": options.output,
        "no_observer_ns_per_request": round(baseline), "history_ns_per_request": round(history_ns),
        "history_cost_ns_per_request": round(history_ns - baseline), "kept": len(full.finished_requests),
        "dump_with_full_history": dumps,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
