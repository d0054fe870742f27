"""Benchmark: online serving of any OpenAI-compatible server, at given request rates or concurrency.

Drives streaming ``POST /v1/completions`` either against a running server (``--base-url``) or
against ours, launched here with the flags after ``--`` (``app.server_process.ServerProcess``:
stopped, with every process reaped, at the end)::

    python tools/bench_serving.py [--base-url URL] [--model NAME] [--api-key KEY]
        [--num-prompts 200] [--random-input-len 1024] [--random-output-len 128]
        [--random-range-ratio 1.0] [--request-rate 4 16 inf] [--max-concurrency 64]
        [--client-procs N|auto] [--offline] [--output-json PATH] [-- SERVER FLAGS]
    python tools/bench_serving.py --num-prompts 64 --request-rate 8 inf            # ours, embedded tiny model
    python tools/bench_serving.py --num-prompts 256 --random-input-len 16 --random-output-len 512 \
        --client-procs 4 --offline -- --model-path /tmp/models/llama-3.2-1b --dtype bfloat16  # HTTP / offline
    python tools/bench_serving.py --request-rate 16 -- --model-path /tmp/models/llama-3.2-1b --dtype bfloat16
    python tools/bench_serving.py --base-url http://127.0.0.1:30000 --max-concurrency 1 16 128
    python tools/bench_serving.py --overload --num-prompts 200 -- --max-running-requests 8   # overload study

Workload (``--dataset random``, the only one so far): each prompt is a list of token ids (the
OpenAI API accepts ``prompt: [ids...]``), so the input length is exact whatever the tokenizer;
ids are drawn uniformly from ``[--token-id-low, --token-id-high)`` (default 1000..10000), with
the high end cut to the model's vocabulary when the server says it (``GET /model_info``'s
``vocab_size``, ours; and the low end then lowered to at most half of it). Each request asks for
``max_tokens`` output tokens with ``ignore_eos: true`` (an extra body field that SGLang, vLLM and
this server accept; ``--disable-ignore-eos`` leaves it out for servers that refuse it), so the
output length is exact too. With ``--random-range-ratio r`` each length is drawn uniformly in
``[r * len, len]`` (at least 1); the default 1.0 gives fixed lengths. ``--seed`` makes a run
reproducible; every level draws its own prompts and arrival times from (seed, level index), so
that no level finds its prompts already in a prefix cache filled by an earlier one.

Load: one level per (``--request-rate``, ``--max-concurrency``) pair, ``--num-prompts``
requests each. With a finite rate, requests are sent at Poisson arrival times (exponential gaps
of mean 1/rate, from a seeded RNG); ``inf`` sends them all at once. ``--max-concurrency C``
caps the requests in flight (a trio.Semaphore; a request that arrives while C are in flight
waits for a free slot, and its clock starts when it is sent). One warm-up request (not counted)
precedes the levels.

Client processes (``--client-procs N``, tools/loadgen/procs.py): a level's requests are sent from
N processes, each with its own trio loop and httpx client, so that the client's own CPU (tens of
µs per chunk: one process can saturate its core before the server does) does not cap the figures.
The arrival times are drawn once here and the requests dealt round-robin, so the level's schedule
is the one a single process would keep; ``--max-concurrency C`` is split as evenly as it goes
(C // N, +1 for the first C % N), a cap per process; every process starts on one start time on
the machine-wide monotonic clock, and the figures are computed from all requests together, as
with one. ``1`` sends from this process; ``auto`` (0, the default): one process per 64 streams
that a level may keep in flight (its cap, or all its prompts), at most half the cores (the other
half for a server on the same machine). Each level reports every process's CPU seconds, their
mean share of a core over the level's duration and the busiest one's; past 80 % the report warns
that the client may be the bottleneck, with the process count that would keep each near half a
core (``client_bound``, ``client_procs_suggested``). The processes are always ended (after an
error or Ctrl-C too; on Linux the kernel kills them with this process).

Metrics, per request, on the machine's monotonic clock (``time.perf_counter``: CLOCK_MONOTONIC,
one clock for every client process):

- **TTFT**: request sent → the first chunk that shows output (non-empty ``text``, or a rise of
  ``usage.completion_tokens`` when the server streams usage in every chunk). A stream whose
  tokens all decode to no text (random weights; a model vocabulary larger than the tokenizer's)
  shows none when usage comes only at the end: it completes, its tokens counted, but without a
  TTFT or ITL (the level's ``ttft_unknown``; ``--continuous-usage-stats`` times such tokens).
- **ITL** (inter-token latency): the gaps between successive chunks that show output. A chunk
  carrying k tokens counts as k gaps of gap/k each, k taken from the rise of
  ``usage.completion_tokens`` when every chunk has usage (``--continuous-usage-stats`` asks vLLM
  and ours for it), else k = 1 per chunk. The first chunk's tokens are covered by TTFT, not ITL.
- **E2E latency**: request sent → the end of the stream.
- **Output tokens**: ``usage.completion_tokens``, from the server's usage only, never from the
  text (every request asks ``stream_options: {"include_usage": true}``; the final usage chunk, or
  the latest usage with continuous usage stats), so an output without text is no error.
- **Input tokens**: ``usage.prompt_tokens``, else the number of ids sent.
- **Errors**, counted by kind and excluded from every latency figure: ``http_<status>`` (an
  answer other than 200), ``stream_error`` (an error event inside the stream), ``no_finish``
  (a stream that ended without a ``finish_reason``), ``finish_abort`` (finish_reason "abort"),
  ``no_usage`` (a stream with no usage at all: its tokens are unknown), ``no_output`` (the usage
  says 0 completion tokens, although every request asks for at least one), ``bad_chunk`` (a chunk that is not JSON), ``timeout`` (past ``--timeout``), or the name of any
  other exception (``ConnectError``, ``RemoteProtocolError``...). An error never stops a run.

Per level: completed and failed requests; duration (the level's first send → its last
request's end); request throughput (completed / duration); input, output and total tokens/s
(completed requests' tokens / duration); TTFT, ITL and E2E mean, p50 and p99 in ms
(percentiles interpolated linearly between ranks, as numpy's default); the most requests in
flight at once (over every client process); the client processes' CPU (above). When the server is ours, ``GET /server_info`` gives
the scheduler's ``step_timing`` (summed over its steps: ``step_s`` wall time inside steps,
``device_s`` device time of their forward and sampling, from CUDA events; on a CPU device the
forward's host time); it is read before and after each level, and the level reports the
difference: ``steps``, ``device_busy_share`` = Δdevice_s / Δactive_s (``active_s``: the wall
time the scheduler had work, its steps and the actor's work between them; servers without it:
Δstep_s), and ``outside_gpu_share`` = 1 − device_busy_share, the share of that time the device
is not working (scheduling, Python, messaging, waiting: the overhead the actor design must keep
small); ``device_share_of_duration`` = Δdevice_s / duration also counts idle time, when no
request was there. All null for other servers.

Overload study (``--overload``, instead of ``--request-rate`` and ``--max-concurrency``): how the
server behaves past its capacity with a bounded queue (``--max-queued-requests``, docs/backpressure.md).
Our launched server gets ``--max-queued-requests Q`` (the tool's flag of that name, default 16) unless
its flags after ``--`` set it; a running server (``--base-url``) must have been started with one.
Three levels of ``--num-prompts`` requests each, in this order:

1. ``saturation``: C requests kept in flight (``--max-concurrency C``, closed loop), C = the server's
   ``max_running_requests`` + ``max_queued_requests`` from ``/server_info`` (``--saturation-concurrency``
   for other servers): the batch stays full and the queue should not overflow (it may, when a whole
   batch ends in one step and its successors arrive at once: those refusals are counted, and the
   throughput is still the server's). Its request throughput is the **saturation rate** S.
2. ``unloaded``: Poisson arrivals at S / 2; its admitted TTFT p99 is the baseline.
3. ``overload``: Poisson arrivals at 2 S.

In all three a 503 answer is a **refusal**, not an error: ``refused`` counts them, ``refused_share``
is their share of the level's requests and ``refusal_ms`` their latency (request sent → the whole
503 answer read); every other figure (TTFT, tokens, throughput) is the admitted requests'. The
report's ``overload`` object holds the study: S, the rates, the overload level's 503 share and
refusal p50/p99, the admitted TTFT p99 loaded and unloaded and their ratio, and whether issue 34's
targets hold (``refusal_p99_under_10_ms``, ``ttft_p99_within_2x``; null without a figure), also printed
as lines before the table. The tool reports the targets; it never fails a run on them.

Offline comparison (``--offline``, tools/loadgen/offline.py; our launched server only): once the
levels have run and the server has stopped, ``tools/bench_offline.py`` runs the same workload
(``--num-prompts``, the input and output lengths; fixed at the nominal lengths, so with a range
ratio below 1 it is the longest case) with the server's engine flags (``--model-path``,
``--dtype``...; its queue bound and timeouts left out), once per distinct concurrency cap (a
level capped at C against the engine with ``--max-running-requests`` C, at most the server's).
Each level gets ``offline_output_tok_s`` and ``vs_offline`` (its output tokens/s over the
offline run's), printed as a line and two table columns; ``report["offline"]["runs"]`` holds
each run's figures and command. A level at a finite request rate is bounded by its rate.

Output: one line per level as it ends, then a table, then (the last line) one JSON object with
every level; ``--output-json PATH`` writes the same object, with every request's figures added
(``sent_at`` and ``ended_at`` in seconds from the level's first send, ``client_proc`` the process that
sent it).
The exit code is 0 whatever the requests answered; 1 only when nothing could be run (the server
did not start, no model to name).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from app.server_process import ServerProcess  # noqa: E402
from loadgen.offline import engine_max_running, offline_cap, offline_flags, run_offline, with_max_running  # noqa: E402
from loadgen.procs import (  # noqa: E402
    CLIENT_BOUND_SHARE, STREAMS_PER_CLIENT_PROC, ClientConfig, ClientPool, LocalClients, ShareResult,
    auto_client_procs, make_client,
    split_level, suggested_client_procs,
)
from loadgen.stream import Outcome, RequestSpec, Target, send_request  # noqa: E402

DEFAULT_TOKEN_ID_LOW = 1000
DEFAULT_TOKEN_ID_HIGH = 10000

# ---------------------------------------------------------------- workload


def draw_length(rng: random.Random, length: int, range_ratio: float) -> int:
    """Uniform in [range_ratio * length, length], at least 1."""
    return max(1, rng.randint(max(1, math.ceil(range_ratio * length)), length))


def make_requests(
    seed: str, num: int, input_len: int, output_len: int, range_ratio: float, id_low: int, id_high: int
) -> list[RequestSpec]:
    """``num`` random prompts of token ids in [id_low, id_high), reproducible from ``seed``."""
    rng = random.Random(seed)
    specs = []
    for _ in range(num):
        n_in = draw_length(rng, input_len, range_ratio)
        n_out = draw_length(rng, output_len, range_ratio)
        specs.append(RequestSpec([rng.randrange(id_low, id_high) for _ in range(n_in)], n_out))
    return specs


def arrival_offsets(seed: str, num: int, rate: float) -> list[float]:
    """Seconds from the level's start at which each request is sent: Poisson arrivals at
    ``rate`` requests/s (exponential gaps), or all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def token_id_range(low: int, high: int, vocab_size: int | None) -> tuple[int, int]:
    """[low, high) cut to the vocabulary: high at most vocab_size, low at most half of high."""
    if vocab_size is not None and vocab_size < high:
        high = vocab_size
        low = min(low, high // 2)
    if not 0 <= low < high:
        raise ValueError(f"empty token id range [{low}, {high})")
    return low, high


# ---------------------------------------------------------------- levels


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of a non-empty list, linear between ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def summary_ms(values: list[float]) -> dict[str, float | None]:
    """mean, p50 and p99 of seconds, in ms; all None for no values."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    return {
        "mean": round(sum(values) / len(values) * 1e3, 3),
        "p50": round(percentile(values, 50) * 1e3, 3),
        "p99": round(percentile(values, 99) * 1e3, 3),
    }


def length_summary(values: list[int]) -> dict[str, float | None]:
    if not values:
        return {"min": None, "mean": None, "max": None}
    return {"min": min(values), "mean": round(sum(values) / len(values), 2), "max": max(values)}


def find_step_timing(info: Any) -> dict[str, Any] | None:
    """The ``step_timing`` dict of a /server_info answer (top level or one level down)."""
    if not isinstance(info, dict):
        return None
    if isinstance(info.get("step_timing"), dict):
        return info["step_timing"]
    for value in info.values():
        if isinstance(value, dict) and isinstance(value.get("step_timing"), dict):
            return value["step_timing"]
    return None


async def fetch_step_timing(client: httpx.AsyncClient) -> dict[str, Any] | None:
    """The scheduler's step timing from our /server_info; None from any other server."""
    try:
        response = await client.get("/server_info")
        return find_step_timing(response.json()) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def timing_delta(before: dict[str, Any] | None, after: dict[str, Any] | None, duration: float) -> dict[str, Any]:
    """The level's share of the scheduler's step timing (every figure None when unknown)."""
    delta: dict[str, Any] = {
        "steps": None, "device_busy_share": None, "outside_gpu_share": None, "device_share_of_duration": None,
        "step_timing": None,
    }
    if before is None or after is None:
        return delta
    keys = [k for k, v in after.items() if isinstance(v, int | float) and isinstance(before.get(k), int | float)]
    diff = {k: round(after[k] - before[k], 4) for k in keys if k != "device_busy_share"}
    delta["step_timing"] = diff
    delta["steps"] = diff.get("steps")
    # active_s (the time the scheduler had work, steps and the gaps between them) where the
    # server reports it: with overlap the device also runs between step() calls, so a share of
    # step_s alone can exceed 1.
    step_s, device_s = diff.get("active_s") or diff.get("step_s"), diff.get("device_s")
    if step_s and device_s is not None:
        busy = device_s / step_s
        delta["device_busy_share"] = round(busy, 4)
        delta["outside_gpu_share"] = round(1.0 - busy, 4)
    if device_s is not None and duration > 0:
        delta["device_share_of_duration"] = round(device_s / duration, 4)
    return delta


class Level(NamedTuple):
    index: int
    rate: float
    max_concurrency: int | None
    phase: str | None = None  # the overload study's name for the level; None in a plain run
    count_refusals: bool = False  # a 503 is a refusal (its own count), not an error


REFUSAL = "http_503"  # the error kind the overload study counts as a refusal


async def run_level(
    client: httpx.AsyncClient, clients: LocalClients | ClientPool, target: Target, level: Level,
    specs: list[RequestSpec], offsets: list[float],
) -> tuple[dict[str, Any], list[Outcome], list[int]]:
    """Send ``specs`` at ``offsets`` (at most ``max_concurrency`` in flight) from the client
    processes; the level's figures, its outcomes and the client process of each."""
    timing_before = await fetch_step_timing(client)
    results = await clients.run(target, split_level(specs, offsets, level.max_concurrency, clients.count))
    outcomes = [o for result in results for o in result.outcomes]
    procs = [index for index, result in enumerate(results) for _ in result.outcomes]
    duration = max(o.ended_at for o in outcomes) - min(o.sent_at for o in outcomes)
    timing_after = await fetch_step_timing(client)
    timing = timing_delta(timing_before, timing_after, duration)
    return summarize(level, outcomes, duration, results, timing), outcomes, procs


def peak_in_flight(outcomes: list[Outcome]) -> int:
    """The most requests in flight at once (sent, not yet ended), over every client process."""
    events = sorted([(o.sent_at, 1) for o in outcomes] + [(o.ended_at, -1) for o in outcomes],
                    key=lambda event: (event[0], event[1]))  # an end before a send at the same instant
    peak = in_flight = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    return peak


def client_cpu(results: list[ShareResult], duration: float) -> dict[str, Any]:
    """The client processes' CPU: seconds in all, per process, and as shares of a core over the
    level's duration (the mean and the busiest process's); ``client_bound`` when the busiest one
    passed CLIENT_BOUND_SHARE, with the process count that would keep each near half a core."""
    per_proc = [result.cpu_s for result in results]
    total = sum(per_proc)
    busiest = max(per_proc) / duration if duration > 0 else 0.0
    bound = busiest > CLIENT_BOUND_SHARE
    return {
        "client_procs": len(per_proc),
        "client_cpu_s": round(total, 3),
        "client_cpu_s_per_proc": [round(cpu, 3) for cpu in per_proc],
        "client_cpu_share": round(total / (duration * len(per_proc)), 4) if duration > 0 else None,
        "client_cpu_share_max": round(busiest, 4),
        "client_bound": bound,
        "client_procs_suggested": suggested_client_procs(total, duration) if bound else None,
    }


def summarize(
    level: Level, outcomes: list[Outcome], duration: float, results: list[ShareResult], timing: dict[str, Any]
) -> dict[str, Any]:
    def is_refusal(outcome: Outcome) -> bool:
        return level.count_refusals and outcome.error == REFUSAL

    done = [o for o in outcomes if o.error is None]
    timed = [o for o in done if not math.isnan(o.ttft_s)]
    refused = [o for o in outcomes if is_refusal(o)]
    errors = Counter(o.error for o in outcomes if o.error is not None and not is_refusal(o))
    input_tokens = sum(o.input_tokens for o in done)
    output_tokens = sum(o.output_tokens for o in done)

    def per_s(x: float) -> float:
        return round(x / duration, 2) if duration > 0 else 0.0

    return {
        "phase": level.phase,
        "request_rate": "inf" if math.isinf(level.rate) else level.rate,
        "max_concurrency": level.max_concurrency,
        "num_prompts": len(outcomes),
        "completed": len(done),
        "errors": sum(errors.values()),
        "error_kinds": dict(sorted(errors.items())),
        # Refusals (only where the level counts them): their share of the level's requests and
        # their latency, request sent -> the whole 503 answer read.
        "refused": len(refused) if level.count_refusals else None,
        "refused_share": round(len(refused) / len(outcomes), 4) if level.count_refusals and outcomes else None,
        "refusal_ms": summary_ms([o.e2e_s for o in refused]),
        "duration_s": round(duration, 3),
        "request_throughput": per_s(len(done)),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "input_tok_s": per_s(input_tokens),
        "output_tok_s": per_s(output_tokens),
        "total_tok_s": per_s(input_tokens + output_tokens),
        "ttft_ms": summary_ms([o.ttft_s for o in timed]),
        "itl_ms": summary_ms([gap for o in timed for gap in o.itls_s]),
        "e2e_ms": summary_ms([o.e2e_s for o in done]),
        # Completed requests whose stream showed no output before its end (see StreamState):
        # counted, with their tokens, but in no TTFT or ITL figure.
        "ttft_unknown": len(done) - len(timed),
        "max_concurrency_reached": peak_in_flight(outcomes),
        "input_len": length_summary([o.sent_input_len for o in outcomes]),
        "output_len": length_summary([o.asked_output_len for o in outcomes]),
        **client_cpu(results, duration),
        # Filled by --offline once the levels have run (the server stopped): the offline
        # engine's output tokens/s on this workload and this level's share of it.
        "offline_output_tok_s": None,
        "vs_offline": None,
        **timing,
    }


# ---------------------------------------------------------------- report


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def level_line(figures: dict[str, Any]) -> str:
    """One line per level, printed as it ends."""
    errors = ", ".join(f"{k} {v}" for k, v in figures["error_kinds"].items()) or "none"
    share = figures["outside_gpu_share"]
    refusals = (f", refused {figures['refused']} (p50 {_fmt(figures['refusal_ms']['p50'], 2)} ms, "
                f"p99 {_fmt(figures['refusal_ms']['p99'], 2)} ms)") if figures["refused"] is not None else ""
    return (
        (f"{figures['phase']}: " if figures["phase"] else "")
        + f"rate {figures['request_rate']} conc {_fmt(figures['max_concurrency'])}: "
        f"{figures['completed']}/{figures['num_prompts']} done in {figures['duration_s']:.2f} s, "
        f"{figures['request_throughput']:.2f} req/s, {figures['output_tok_s']:,.1f} out tok/s, "
        f"TTFT p50 {_fmt(figures['ttft_ms']['p50'])} ms, ITL p50 {_fmt(figures['itl_ms']['p50'], 2)} ms, "
        f"E2E p50 {_fmt(figures['e2e_ms']['p50'])} ms, errors: {errors}{refusals}"
        + (f", TTFT unknown for {figures['ttft_unknown']} (no text; --continuous-usage-stats times them)"
           if figures["ttft_unknown"] else "")
        + (f", outside GPU {share:.1%} of step time" if share is not None else "")
        + f", client CPU {figures['client_cpu_share_max']:.0%} of a core (busiest of {figures['client_procs']})"
    )


def client_warning(figures: dict[str, Any]) -> str | None:
    """The warning line of a level whose busiest client process passed CLIENT_BOUND_SHARE."""
    if not figures["client_bound"]:
        return None
    return (f"warning: a client process used {figures['client_cpu_share_max']:.0%} of a core "
            f"({figures['client_procs']} process(es)): the client may be the bottleneck; raise --client-procs "
            f"({figures['client_procs_suggested']} would keep each near half a core)")


TABLE_COLUMNS: list[tuple[str, Any]] = [
    ("rate", lambda f: str(f["request_rate"])),
    ("conc", lambda f: _fmt(f["max_concurrency"])),
    ("done", lambda f: str(f["completed"])),
    ("err", lambda f: str(f["errors"])),
    ("dur s", lambda f: _fmt(f["duration_s"], 2)),
    ("req/s", lambda f: _fmt(f["request_throughput"], 2)),
    ("in tok/s", lambda f: _fmt(f["input_tok_s"])),
    ("out tok/s", lambda f: _fmt(f["output_tok_s"])),
    ("tot tok/s", lambda f: _fmt(f["total_tok_s"])),
    *[
        (f"{name} {stat}", lambda f, key=key, stat=stat: _fmt(f[key][stat], 2))
        for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
        for stat in ("mean", "p50", "p99")
    ],
    ("peak", lambda f: str(f["max_concurrency_reached"])),
    ("steps", lambda f: _fmt(f["steps"])),
    ("out-GPU", lambda f: "-" if f["outside_gpu_share"] is None else f"{f['outside_gpu_share']:.1%}"),
    ("procs", lambda f: str(f["client_procs"])),
    ("cli CPU", lambda f: f"{f['client_cpu_share_max']:.0%}"),
]
OFFLINE_COLUMNS: list[tuple[str, Any]] = [
    ("offline tok/s", lambda f: _fmt(f["offline_output_tok_s"])),
    ("vs off", lambda f: _fmt(f["vs_offline"], 3)),
]


# The overload study's columns: the phase first, the refusals after the errors.
PHASE_COLUMN: tuple[str, Any] = ("phase", lambda f: f["phase"] or "-")
REFUSAL_COLUMNS: list[tuple[str, Any]] = [
    ("refused", lambda f: _fmt(f["refused"])),
    ("ref p50", lambda f: _fmt(f["refusal_ms"]["p50"], 2)),
    ("ref p99", lambda f: _fmt(f["refusal_ms"]["p99"], 2)),
]


def table_columns(levels: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """TABLE_COLUMNS, with the phase and refusal columns when a level counts refusals, and the
    offline columns when the offline engine ran."""
    columns = TABLE_COLUMNS
    if any(f["refused"] is not None for f in levels):
        cut = [name for name, _ in TABLE_COLUMNS].index("err") + 1
        columns = [PHASE_COLUMN, *TABLE_COLUMNS[:cut], *REFUSAL_COLUMNS, *TABLE_COLUMNS[cut:]]
    if any(f["offline_output_tok_s"] is not None for f in levels):
        columns = [*columns, *OFFLINE_COLUMNS]
    return columns


def table(levels: list[dict[str, Any]]) -> str:
    """A plain-text table, one row per level (latencies in ms)."""
    columns = table_columns(levels)
    rows = [[name for name, _ in columns]] + [[cell(f) for _, cell in columns] for f in levels]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------- overload study

DEFAULT_OVERLOAD_QUEUE = 16  # --max-queued-requests the study gives our server when its flags do not
UNLOADED_SHARE = 0.5  # the unloaded level's rate, as a share of the saturation rate
OVERLOAD_FACTOR = 2.0  # the overload level's rate, as a multiple of the saturation rate
TARGET_REFUSAL_P99_MS = 10.0  # issue 34: a refusal answered in under 10 ms (p99)
TARGET_TTFT_P99_RATIO = 2.0  # issue 34: admitted requests' TTFT p99 within 2x of the unloaded run's


def with_queue_bound(server_args: list[str], queue: int) -> list[str]:
    """Our server's flags with ``--max-queued-requests queue`` added unless they set it already."""
    if any(a == "--max-queued-requests" or a.startswith("--max-queued-requests=") for a in server_args):
        return server_args
    return [*server_args, "--max-queued-requests", str(queue)]


async def fetch_server_limits(client: httpx.AsyncClient) -> tuple[int | None, int | None]:
    """(max_running_requests, max_queued_requests) from our /server_info; None where unknown."""
    try:
        response = await client.get("/server_info")
        info = response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return None, None
    if not isinstance(info, dict):
        return None, None
    parts = [info, *(value for value in info.values() if isinstance(value, dict))]  # top level, one down

    def first(key: str) -> int | None:
        return next((part[key] for part in parts if isinstance(part.get(key), int)), None)

    return first("max_running_requests"), first("max_queued_requests")


class ServerLimits(NamedTuple):
    """What the overload study knows of the server's limits (None: not said)."""

    max_running_requests: int | None
    max_queued_requests: int | None
    saturation_concurrency: int  # requests the saturation level keeps in flight


async def server_limits(client: httpx.AsyncClient, args: argparse.Namespace) -> ServerLimits:
    """The server's limits; the saturation level's concurrency is ``--saturation-concurrency``, else
    the running batch plus the queue bound (a full batch, a queue that should not overflow)."""
    running, queued = await fetch_server_limits(client)
    if args.saturation_concurrency:
        return ServerLimits(running, queued, args.saturation_concurrency)
    if running is None or queued is None:
        raise RuntimeError("--overload: the server's /server_info names no max_running_requests and "
                           "max_queued_requests (a bounded queue); give --saturation-concurrency")
    return ServerLimits(running, queued, running + queued)


async def overload_study(run: Callable[[Level], Awaitable[dict[str, Any]]], limits: ServerLimits) -> dict[str, Any]:
    """The three levels of the study, run with ``run``; the study's figures and targets."""
    concurrency = limits.saturation_concurrency
    saturation = await run(Level(0, math.inf, concurrency, "saturation", count_refusals=True))
    rate = saturation["request_throughput"]
    if not rate > 0:
        raise RuntimeError("--overload: the saturation level completed no request")
    unloaded = await run(Level(1, round(rate * UNLOADED_SHARE, 3), None, "unloaded", count_refusals=True))
    loaded = await run(Level(2, round(rate * OVERLOAD_FACTOR, 3), None, "overload", count_refusals=True))
    refusal_p99 = loaded["refusal_ms"]["p99"]
    ttft_unloaded, ttft_loaded = unloaded["ttft_ms"]["p99"], loaded["ttft_ms"]["p99"]
    ratio = round(ttft_loaded / ttft_unloaded, 3) if ttft_loaded and ttft_unloaded else None
    return {
        "max_running_requests": limits.max_running_requests,
        "max_queued_requests": limits.max_queued_requests,
        "saturation_concurrency": concurrency,
        "saturation_rate": rate,
        "unloaded_rate": unloaded["request_rate"],
        "overload_rate": loaded["request_rate"],
        "refused_share": loaded["refused_share"],
        "refusal_ms": loaded["refusal_ms"],
        "ttft_p99_ms": {"unloaded": ttft_unloaded, "overload": ttft_loaded},
        "ttft_p99_ratio": ratio,
        # None where the figure is missing (no refusal, no admitted request).
        "refusal_p99_under_10_ms": None if refusal_p99 is None else refusal_p99 < TARGET_REFUSAL_P99_MS,
        "ttft_p99_within_2x": None if ratio is None else ratio <= TARGET_TTFT_P99_RATIO,
    }


def overload_lines(study: dict[str, Any]) -> list[str]:
    """The study's figures and whether each target of issue 34 holds, for people."""

    def verdict(held: bool | None) -> str:
        return "no figure" if held is None else ("holds" if held else "does NOT hold")

    refusal = study["refusal_ms"]
    return [
        f"overload study (queue bound {_fmt(study['max_queued_requests'])}): saturation "
        f"{study['saturation_rate']} req/s ({study['saturation_concurrency']} in flight), unloaded at "
        f"{study['unloaded_rate']} req/s, overload at {study['overload_rate']} req/s",
        f"  refused: {_fmt(study['refused_share'], 4)} of the overload level's requests, "
        f"refusal latency p50 {_fmt(refusal['p50'], 2)} ms, p99 {_fmt(refusal['p99'], 2)} ms: "
        f"under {TARGET_REFUSAL_P99_MS:g} ms p99 {verdict(study['refusal_p99_under_10_ms'])}",
        f"  admitted TTFT p99 {_fmt(study['ttft_p99_ms']['overload'], 2)} ms against "
        f"{_fmt(study['ttft_p99_ms']['unloaded'], 2)} ms unloaded (x{_fmt(study['ttft_p99_ratio'], 2)}): "
        f"within {TARGET_TTFT_P99_RATIO:g}x {verdict(study['ttft_p99_within_2x'])}",
    ]


# ---------------------------------------------------------------- run


async def discover_model(client: httpx.AsyncClient) -> str:
    """The first id of GET /v1/models; RuntimeError when it names none."""
    response = await client.get("/v1/models")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"GET /v1/models answered {response.status_code} without a model id: "
                           f"{response.text[:200]!r}; name one with --model") from None


async def fetch_vocab_size(client: httpx.AsyncClient) -> int | None:
    """``vocab_size`` from our GET /model_info; None from servers without it."""
    try:
        response = await client.get("/model_info")
        size = response.json().get("vocab_size") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) and size > 0 else None


def client_config(base_url: str, args: argparse.Namespace) -> ClientConfig:
    concurrency = [c for c in args.max_concurrency if c] if args.max_concurrency else []
    unlimited = not concurrency or len(concurrency) < len(args.max_concurrency)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return ClientConfig(base_url, headers, args.timeout, None if unlimited else max(concurrency) + 2)  # + /server_info's


def planned_streams(args: argparse.Namespace) -> int:
    """The most streams a level may keep in flight: every prompt, or the largest cap when every
    level has one."""
    caps = args.max_concurrency or []
    if args.overload or not caps or 0 in caps:
        return args.num_prompts
    return min(args.num_prompts, max(caps))


def client_procs(args: argparse.Namespace) -> int:
    """``--client-procs``, with 0 (auto) resolved by the documented rule (loadgen.procs)."""
    return args.client_procs or auto_client_procs(planned_streams(args), os.cpu_count() or 1)


def request_details(outcomes: list[Outcome], procs: list[int]) -> list[dict[str, Any]]:
    """Every request's figures for --output-json, ``sent_at``/``ended_at`` in seconds from the
    level's first send, with the client process that sent it."""
    first = min(o.sent_at for o in outcomes)
    return [{**o._asdict(), "sent_at": round(o.sent_at - first, 6), "ended_at": round(o.ended_at - first, 6),
             "client_proc": proc} for o, proc in zip(outcomes, procs)]


async def benchmark(base_url: str, args: argparse.Namespace, launched: bool) -> tuple[dict[str, Any], list[Any]]:
    """Run the levels; the report and every level's request details."""
    config = client_config(base_url, args)
    async with make_client(config) as client:
        model = args.model or await discover_model(client)
        vocab = await fetch_vocab_size(client)
        low, high = token_id_range(args.token_id_low, args.token_id_high, vocab)
        target = Target(model, args.temperature, not args.disable_ignore_eos, args.continuous_usage_stats,
                        json.loads(args.extra_body) if args.extra_body else {})
        procs = client_procs(args)
        print(f"target {base_url}: model {model}, vocabulary {vocab or 'unknown'}, token ids [{low}, {high}), "
              f"{args.num_prompts} prompts per level, input {args.random_input_len} and output "
              f"{args.random_output_len} tokens (range ratio {args.random_range_ratio}), "
              f"{procs} client process(es)", flush=True)
        for i in range(args.warmup_requests):
            spec = make_requests(f"warmup/{args.seed}/{i}", 1, min(16, args.random_input_len), 4, 1.0, low, high)[0]
            warm = await send_request(client, target, spec)
            if warm.error is not None:
                print(f"warm-up request failed: {warm.error}", flush=True)
        results, details = [], []
        with ClientPool(procs, config) if procs > 1 else nullcontext(LocalClients(client)) as clients:
            if isinstance(clients, ClientPool):
                await clients.wait_ready()

            async def run(level: Level) -> dict[str, Any]:
                specs = make_requests(f"prompts/{args.seed}/{level.index}", args.num_prompts, args.random_input_len,
                                      args.random_output_len, args.random_range_ratio, low, high)
                offsets = arrival_offsets(f"arrivals/{args.seed}/{level.index}", args.num_prompts, level.rate)
                figures, outcomes, sent_by = await run_level(client, clients, target, level, specs, offsets)
                print(level_line(figures), flush=True)
                warning = client_warning(figures)
                if warning:
                    print(warning, flush=True)
                results.append(figures)
                details.append(request_details(outcomes, sent_by))
                return figures

            overload = None
            if args.overload:
                overload = await overload_study(run, await server_limits(client, args))
                for line in overload_lines(overload):
                    print(line, flush=True)
            else:
                for i, (conc, rate) in enumerate(
                        (conc, rate) for conc in (args.max_concurrency or [None]) for rate in args.request_rate):
                    await run(Level(i, rate, conc))
        max_running = (await fetch_server_limits(client))[0] if args.offline else None
    settings = {k: v for k, v in vars(args).items() if k not in ("api_key", "output_json")}
    settings["request_rate"] = ["inf" if math.isinf(r) else r for r in args.request_rate]
    settings["client_procs"] = procs
    report = {"base_url": base_url, "launched": launched, "model": model, "token_id_range": [low, high],
              "config": settings, "max_running_requests": max_running, "levels": results}
    if overload is not None:
        report["overload"] = overload
    return report, details


def compare_offline(report: dict[str, Any], args: argparse.Namespace) -> None:
    """--offline: bench_offline.py on the levels' workload, one run per distinct concurrency cap
    (loadgen.offline); each level's offline figure and ratio filled in, the runs in
    ``report["offline"]``, a line per level printed."""
    flags = offline_flags(args.server_args)
    server_cap = report["max_running_requests"] or engine_max_running(flags)
    runs: dict[int | None, dict[str, Any]] = {}
    for level in report["levels"]:
        cap = offline_cap(level["max_concurrency"], server_cap)
        if cap not in runs:
            limit = f"at most {cap} running" if cap else "the server's flags"
            print(f"offline engine: {args.num_prompts} x ({args.random_input_len} -> {args.random_output_len}), "
                  f"{limit}...", flush=True)
            runs[cap] = run_offline(with_max_running(flags, cap), args.num_prompts, args.random_input_len,
                                    args.random_output_len, args.seed, args.timeout)
        offline = runs[cap]["output_tokens_per_s"]
        level["offline_output_tok_s"] = offline
        level["vs_offline"] = round(level["output_tok_s"] / offline, 4) if offline else None
        print(f"rate {level['request_rate']} conc {_fmt(level['max_concurrency'])}: HTTP {level['output_tok_s']:,.1f} "
              f"out tok/s, offline {offline:,.1f}: x{_fmt(level['vs_offline'], 3)}", flush=True)
    report["offline"] = {"runs": [{"max_running_requests": cap, **figures} for cap, figures in runs.items()],
                         "fixed_lengths": args.random_range_ratio < 1.0}
    if args.random_range_ratio < 1.0:
        print("offline engine: fixed lengths (the nominal ones), while the HTTP levels drew them with "
              f"--random-range-ratio {args.random_range_ratio}", flush=True)


def _clean(value: Any) -> Any:
    """NaN (a failed request's TTFT) as null, so that the JSON is strict."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def client_procs_value(text: str) -> int:
    """--client-procs: a count of at least 1, or 0 / auto."""
    if text == "auto":
        return 0
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count or auto: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0 (0: auto), got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", help="a running OpenAI-compatible server (default: launch ours with the "
                        "flags after --)")
    target.add_argument("--model", help="the model id to send (default: the first of GET /v1/models)")
    target.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    target.add_argument("--timeout", type=float, default=600.0, help="seconds, per connect/read/write")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--dataset", choices=["random"], default="random")
    workload.add_argument("--num-prompts", type=int, default=200, help="requests per level")
    workload.add_argument("--random-input-len", type=int, default=1024)
    workload.add_argument("--random-output-len", type=int, default=128)
    workload.add_argument("--random-range-ratio", type=float, default=1.0,
                          help="each length uniform in [ratio * len, len]; 1.0: fixed lengths")
    workload.add_argument("--token-id-low", type=int, default=DEFAULT_TOKEN_ID_LOW)
    workload.add_argument("--token-id-high", type=int, default=DEFAULT_TOKEN_ID_HIGH, help="exclusive")
    workload.add_argument("--seed", type=int, default=1)
    workload.add_argument("--temperature", type=float, default=0.0)
    workload.add_argument("--disable-ignore-eos", action="store_true", help="do not send ignore_eos")
    workload.add_argument("--continuous-usage-stats", action="store_true",
                          help="ask for usage in every chunk (vLLM's stream_options.continuous_usage_stats)")
    workload.add_argument("--extra-body", help="a JSON object merged into every request body")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                      help="requests/s, Poisson arrivals; inf: all at once; several: one level each")
    load.add_argument("--max-concurrency", type=int, nargs="+", default=None,
                      help="most requests in flight (default: no cap); several: one level each, with every rate")
    load.add_argument("--warmup-requests", type=int, default=1, help="sent before the levels, not counted")
    study = parser.add_argument_group("overload study")
    study.add_argument("--overload", action="store_true",
                       help="the overload study (saturation, unloaded, twice saturation) instead of the given "
                       "rates; see the docstring")
    study.add_argument("--max-queued-requests", type=int, default=DEFAULT_OVERLOAD_QUEUE,
                       help="--overload: the queue bound given to our launched server when its flags after -- "
                       "set none")
    study.add_argument("--saturation-concurrency", type=int, default=None,
                       help="--overload: requests in flight at the saturation level; None: the server's "
                       "max_running_requests + max_queued_requests from /server_info")
    clients = parser.add_argument_group("client")
    clients.add_argument("--client-procs", type=client_procs_value, default=0, metavar="N|auto",
                         help="client processes that send each level's requests (1: this process alone); "
                         f"0 or auto: one per {STREAMS_PER_CLIENT_PROC} streams in flight, at most half the cores")
    parser.add_argument("--offline", action="store_true",
                        help="after the levels (our launched server stopped): tools/bench_offline.py on the same "
                        "workload with the server's engine flags, and each level's HTTP/offline output tok/s")
    parser.add_argument("--output-json", help="write the report here too, with every request's figures")
    parser.add_argument("server_args", nargs="*", help="after --: flags for `python -m app serve`")
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        parser.error("--num-prompts, --random-input-len and --random-output-len must be at least 1")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        parser.error("--random-range-ratio must be in [0, 1]")
    if any(not r > 0 for r in args.request_rate):
        parser.error("--request-rate must be positive (inf: all at once)")
    if args.max_concurrency and any(c < 0 for c in args.max_concurrency):
        parser.error("--max-concurrency must be at least 1 (0: no cap)")
    if args.base_url and args.server_args:
        parser.error("server flags after -- only apply when launching ours (no --base-url)")
    if args.base_url and args.offline:
        parser.error("--offline runs our engine with the flags after --: it needs our launched server (no --base-url)")
    if args.extra_body and not isinstance(json.loads(args.extra_body), dict):
        parser.error("--extra-body must be a JSON object")
    if args.overload and (args.max_concurrency or args.request_rate != [math.inf]):
        parser.error("--overload picks its own rates: leave out --request-rate and --max-concurrency")
    if args.max_queued_requests < 1 or (args.saturation_concurrency is not None and args.saturation_concurrency < 1):
        parser.error("--max-queued-requests and --saturation-concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.base_url:
            report, details = trio.run(benchmark, args.base_url.rstrip("/"), args, False)
        else:
            server_args = with_queue_bound(args.server_args, args.max_queued_requests) if args.overload \
                else args.server_args
            with ServerProcess(*server_args) as server:
                url = server.wait_serving()
                report, details = trio.run(benchmark, url, args, True)
        if args.offline:
            compare_offline(report, args)
    except (RuntimeError, ValueError, httpx.HTTPError) as exc:
        print(f"bench_serving: cannot run: {exc!r}", file=sys.stderr)
        return 1
    if args.output_json:
        full = {**report, "levels": [{**f, "requests": d} for f, d in zip(report["levels"], details)]}
        Path(args.output_json).write_text(json.dumps(_clean(full), indent=1, allow_nan=False) + "\n")
    print()
    print(table(report["levels"]))
    print(json.dumps(_clean(report), allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
