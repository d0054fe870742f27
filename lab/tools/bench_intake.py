"""Benchmark: the intake of a burst of requests, and where each request's time goes, actor by actor.

Launches our server (``app.server_process.ServerProcess``, the flags after ``--``; the embedded
tiny model by default) with ``APP_TRACE_DIR`` set, so that every process writes a timestamp when
a request reaches it (``app/ipc/trace.py``), then sends bursts of ``--num-requests`` concurrent
``POST /v1/completions`` (all at once, one connection each, as bench_serving's ``inf`` rate
does), each a prompt of ``--input-len`` random token ids with ``max_tokens`` from
``--max-tokens`` (``ignore_eos``, so the output length is exact), plain and streamed::

    python lab/tools/bench_intake.py [--num-requests 128] [--input-len 512] [--max-tokens 0 1]
        [--modes plain stream] [--rounds 3] [--no-trace] [--output-json PATH] [-- SERVER FLAGS]

``max_tokens: 0`` finishes in the scheduler without a forward step: the burst then measures the
serving path alone (HTTP, the four actors, the channels, the answer), which is what this tool is
for; ``max_tokens: 1`` adds the prefill of every prompt.

The client is a small HTTP/1.1 client over trio sockets (not httpx), so that on a small machine
it takes little of the CPU the server needs. Every answer is checked: status 200, and
``usage.completion_tokens`` equal to ``max_tokens`` (``usage`` of the last chunk when streamed,
asked for with ``stream_options.include_usage``); anything else counts as an error.

Per round (all figures in ms unless named otherwise, times on the host's monotonic clock, which
the server's trace lines share):

- ``burst_ms``: the first request's start → the last answer's end;
- ``latency``: each request's start → its answer's end (p50, p90, p99, max), and ``first_ms``
  (start → the first body bytes: the whole answer, or the first streamed event);
- ``stages``: for each step of a request's path, p50 and max over the requests of the time it
  took, from the trace: ``client→http`` (connection, the request read by hypercorn, up to our
  handler), ``http→ingress`` (body decoded, validated, converted into a GenerateRequest),
  ``ingress→tokenizer`` (the channel), ``tokenizer`` (ids checked, packed, sent on),
  ``→scheduler`` (channel), ``scheduler inbox`` (received → added to the engine, including the
  wait for the step in flight), ``scheduler→ingress`` (added → the final output routed in the
  ingress: the steps, the detokenizer, two channels), ``ingress→client`` (the response written
  and read);
- ``arrivals``: when the burst's requests reached each actor, first and last, from the burst's
  start: how serialised the intake is;
- ``steps``: the scheduler's steps during the round, and (``messages_per_step``, the first 40)
  how many messages it applied before each: how well it batches what arrives during a step;
- ``cpu_s``: CPU seconds of each process during the round (``/proc/<pid>/stat``) and the
  client's own; a process near ``burst_ms`` is the bottleneck;
- ``floor_ms``: the same bodies decoded and converted in this process, in a loop (msgspec decode
  into CompletionRequest, conversion, the tokenizer's checks): the Python work no design avoids.

Output: a line per round, a table of the best round per (max_tokens, mode), then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import trio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root, for app
sys.path.insert(0, str(ROOT / "tools"))  # for bench_serving

from app.server_process import ServerProcess  # noqa: E402
from bench_serving import percentile  # noqa: E402

_TICKS = os.sysconf("SC_CLK_TCK")

# ---------------------------------------------------------------- a small HTTP/1.1 client


class Answer(NamedTuple):
    rid: str
    start: float  # time.monotonic()
    first: float  # the first body bytes
    end: float
    status: int
    completion_tokens: int | None
    error: str | None


def _usage_tokens(document: Any) -> int | None:
    usage = document.get("usage") if isinstance(document, dict) else None
    return usage.get("completion_tokens") if isinstance(usage, dict) else None


async def _read_until(stream: trio.SocketStream, buffer: bytearray, marker: bytes) -> int:
    while (index := buffer.find(marker)) < 0:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        buffer += data
    return index


async def _read_exactly(stream: trio.SocketStream, buffer: bytearray, size: int) -> None:
    while len(buffer) < size:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        buffer += data


async def post(host: str, port: int, rid: str, body: bytes, stream_answer: bool) -> Answer:
    """One POST /v1/completions on a fresh connection, timed; never raises."""
    start = first = time.monotonic()
    status, tokens = 0, None
    try:
        async with await trio.open_tcp_stream(host, port) as stream:
            head = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
                    f"x-request-id: {rid}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n")
            await stream.send_all(head.encode() + body)
            buffer = bytearray()
            end_of_head = await _read_until(stream, buffer, b"\r\n\r\n")
            first = time.monotonic()
            lines = bytes(buffer[:end_of_head]).decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            del buffer[: end_of_head + 4]
            if "content-length" in headers:
                await _read_exactly(stream, buffer, int(headers["content-length"]))
                content = bytes(buffer)
            else:  # chunked: hypercorn's streamed answers
                parts, first_event = [], None
                while True:
                    line_end = await _read_until(stream, buffer, b"\r\n")
                    size = int(bytes(buffer[:line_end]).split(b";")[0], 16)
                    await _read_exactly(stream, buffer, line_end + 2 + size + 2)
                    if first_event is None and size:
                        first_event = time.monotonic()
                    parts.append(bytes(buffer[line_end + 2 : line_end + 2 + size]))
                    del buffer[: line_end + 2 + size + 2]
                    if size == 0:
                        break
                first = first_event or first
                content = b"".join(parts)
        if status != 200:
            return Answer(rid, start, first, time.monotonic(), status, None, f"http_{status}")
        if stream_answer:
            events = [line[6:] for line in content.split(b"\n") if line.startswith(b"data: {")]
            if any(b'"error"' in event[:12] for event in events):
                return Answer(rid, start, first, time.monotonic(), status, None, "stream_error")
            tokens = _usage_tokens(msgspec.json.decode(events[-1])) if events else None
        else:
            tokens = _usage_tokens(msgspec.json.decode(content))
        return Answer(rid, start, first, time.monotonic(), status, tokens, None)
    except (OSError, ValueError, IndexError, msgspec.DecodeError) as exc:
        return Answer(rid, start, first, time.monotonic(), status, tokens, type(exc).__name__)


# ---------------------------------------------------------------- workload and figures


def make_bodies(seed: str, num: int, input_len: int, max_tokens: int, stream: bool, vocab: int,
                model: str) -> list[bytes]:
    rng = random.Random(seed)
    low = min(1000, vocab // 2)
    bodies = []
    for _ in range(num):
        body: dict[str, Any] = {"model": model, "prompt": [rng.randrange(low, vocab) for _ in range(input_len)],
                                "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        bodies.append(msgspec.json.encode(body))
    return bodies


def dist_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    return {name: round(percentile(values, q) * 1e3, 2) for name, q in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))}


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """utime + stime of each process, in seconds (0.0 for one that is gone)."""
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / _TICKS
        except (OSError, IndexError, ValueError):
            out[name] = 0.0
    return out


def floor_ms(bodies: list[bytes], model: str, vocab: int, context: int) -> float:
    """The Python work of the intake done in a loop in this process: decode, convert, check ids."""
    from app.actors.tokenizer import Tokenization
    from app.http.backend import ModelCard
    from app.http.openai_adapter import completion_requests
    from app.http.schemas import CompletionRequest
    from app.ipc.messages import SamplingParams

    card = ModelCard(name=model, path="", context_length=context, vocab_size=vocab, architecture="")
    tokenize = Tokenization(None, context_len=context, vocab_size=vocab)  # type: ignore[arg-type]
    decode = msgspec.json.Decoder(CompletionRequest).decode
    defaults = SamplingParams()
    started = time.perf_counter()
    for i, body in enumerate(bodies):
        for request in completion_requests(decode(body), f"f{i}", card, defaults, 0.0):
            tokenize(request)
    return round((time.perf_counter() - started) * 1e3, 2)


# ---------------------------------------------------------------- the trace


def read_trace(folder: Path) -> list[tuple[float, str, str, str]]:
    """Every trace line of every process: (time, event, rid, detail), in time order."""
    lines = []
    for path in folder.glob("*.tsv"):
        for line in path.read_text().splitlines():
            t, event, rid, detail = line.split("\t")
            lines.append((float(t), event, rid, detail))
    lines.sort()
    return lines


# (name, from event, to event): each a request's time between two marks; "client.start" and
# "client.end" are the client's own.
STAGES = [
    ("client→http", "client.start", "http.request"),
    ("http→ingress", "http.request", "ingress.submit"),
    ("ingress→tokenizer", "ingress.submit", "tokenizer.recv"),
    ("tokenizer", "tokenizer.recv", "tokenizer.sent"),
    ("→scheduler", "tokenizer.sent", "scheduler.recv"),
    ("scheduler inbox", "scheduler.recv", "scheduler.add"),
    ("scheduler→ingress", "scheduler.add", "ingress.final"),
    ("ingress→client", "ingress.final", "client.end"),
]
ARRIVALS = ["http.request", "ingress.submit", "tokenizer.recv", "scheduler.recv", "scheduler.add", "ingress.final",
            "client.end"]


def trace_figures(lines: list[tuple[float, str, str, str]], answers: list[Answer], t0: float, t1: float) -> dict[str, Any]:
    """The stages, arrivals and steps of one round, from the trace lines within [t0, t1]."""
    rids = {a.rid for a in answers}
    marks: dict[str, dict[str, float]] = defaultdict(dict)
    steps = []
    for t, event, rid, detail in lines:
        if not t0 <= t <= t1:
            continue
        if event == "scheduler.step":
            steps.append((t, int(detail or 0)))
        elif rid in rids:
            if event == "ingress.out" and detail == "1":
                event = "ingress.final"
            marks[rid].setdefault(event, t)
    for a in answers:
        marks[a.rid]["client.start"] = a.start
        marks[a.rid]["client.end"] = a.end
    stages = {}
    for name, begin, end in STAGES:
        spans = [m[end] - m[begin] for m in marks.values() if begin in m and end in m]
        stages[name] = {"p50": dist_ms(spans)["p50"], "max": dist_ms(spans)["max"], "n": len(spans)}
    arrivals = {}
    for event in ARRIVALS:
        times = [m[event] - t0 for m in marks.values() if event in m]
        arrivals[event] = {"first": round(min(times) * 1e3, 2), "last": round(max(times) * 1e3, 2)} if times else None
    return {"stages": stages, "arrivals": arrivals, "steps": len(steps),
            "messages_per_step": [n for _, n in steps][:40]}


# ---------------------------------------------------------------- run


class Round(NamedTuple):
    max_tokens: int
    stream: bool
    index: int


async def run_round(host: str, port: int, bodies: list[bytes], prefix: str, stream: bool) -> list[Answer]:
    answers: list[Answer] = []

    async def one(i: int) -> None:
        answers.append(await post(host, port, f"{prefix}-{i}", bodies[i], stream))

    async with trio.open_nursery() as nursery:
        for i in range(len(bodies)):
            nursery.start_soon(one, i)
    return answers


def summarize(r: Round, answers: list[Answer], cpu: dict[str, float], floor: float, traced: dict[str, Any] | None,
              max_tokens: int) -> dict[str, Any]:
    errors: dict[str, int] = defaultdict(int)
    for a in answers:
        if a.error is None and a.completion_tokens != max_tokens:
            errors[f"completion_tokens_{a.completion_tokens}"] += 1
        elif a.error is not None:
            errors[a.error] += 1
    start = min(a.start for a in answers)
    return {
        "max_tokens": r.max_tokens,
        "mode": "stream" if r.stream else "plain",
        "round": r.index,
        "requests": len(answers),
        "errors": dict(errors),
        "burst_ms": round((max(a.end for a in answers) - start) * 1e3, 2),
        "latency_ms": dist_ms([a.end - a.start for a in answers]),
        "first_ms": dist_ms([a.first - a.start for a in answers]),
        "cpu_s": {name: round(value, 3) for name, value in cpu.items()},
        "floor_ms": floor,
        **(traced or {}),
    }


def round_line(f: dict[str, Any]) -> str:
    lat = f["latency_ms"]
    cpu = " ".join(f"{k} {v:.2f}" for k, v in f["cpu_s"].items())
    return (f"max_tokens {f['max_tokens']} {f['mode']:>6} round {f['round']}: {f['requests']} requests in "
            f"{f['burst_ms']:.0f} ms, latency p50 {lat['p50']:.0f} p99 {lat['p99']:.0f} max {lat['max']:.0f} ms, "
            f"errors {f['errors'] or 'none'}, steps {f.get('steps', '-')}, cpu s: {cpu}")


def stage_table(f: dict[str, Any]) -> str:
    rows = [("stage", "p50 ms", "max ms")]
    for name, figures in f.get("stages", {}).items():
        rows.append((name, str(figures["p50"]), str(figures["max"])))
    rows.append(("", "", ""))
    rows.append(("reached at", "first ms", "last ms"))
    for event, span in f.get("arrivals", {}).items():
        rows.append((event, *(("-", "-") if span is None else (str(span["first"]), str(span["last"])))))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(cell.rjust(w) if j else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths)))
                     for row in rows)


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    trace_dir = Path(tempfile.mkdtemp(prefix="bench-intake-"))
    env = {} if args.no_trace else {"APP_TRACE_DIR": str(trace_dir)}
    results = []
    with ServerProcess(*args.server_args, env=env) as server:
        url = server.wait_serving()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        import httpx

        info = httpx.get(f"{url}/model_info", timeout=30).json()
        vocab, context, model = info["vocab_size"], info["context_length"], info["served_model_name"]
        pids = {"ingress": server.popen.pid, **{name: pid for name, pid in server.actor_pids().items()}}
        rounds = [Round(m, mode == "stream", i) for m in args.max_tokens for mode in args.modes for i in range(args.rounds)]
        # A warm-up burst (not counted): first-use costs (imports, allocations, compiled paths).
        warm = make_bodies("warm", min(args.num_requests, 16), args.input_len, 1, True, vocab, model)
        trio.run(run_round, host, int(port), warm, "warm", True)
        for r in rounds:
            seed = f"{args.seed}/{r.max_tokens}/{r.stream}/{r.index}"
            bodies = make_bodies(seed, args.num_requests, args.input_len, r.max_tokens, r.stream, vocab, model)
            floor = floor_ms(bodies, model, vocab, context)
            time.sleep(0.3)  # let the server settle (the previous round's stragglers, idle backoffs)
            cpu_before = cpu_seconds(pids)
            client_before = time.process_time()
            t0 = time.monotonic()
            answers = trio.run(run_round, host, int(port), bodies, f"b{r.max_tokens}{'s' if r.stream else 'p'}{r.index}",
                               r.stream)
            t1 = time.monotonic()
            cpu_after = cpu_seconds(pids)
            cpu = {name: cpu_after[name] - cpu_before[name] for name in pids}
            cpu["client"] = time.process_time() - client_before
            traced = None if args.no_trace else trace_figures(read_trace(trace_dir), answers, t0, t1 + 1.0)
            figures = summarize(r, answers, cpu, floor, traced, r.max_tokens)
            print(round_line(figures), flush=True)
            results.append(figures)
    shutil.rmtree(trace_dir, ignore_errors=True)
    best: dict[tuple[int, str], dict[str, Any]] = {}
    for f in results:
        key = (f["max_tokens"], f["mode"])
        if key not in best or f["burst_ms"] < best[key]["burst_ms"]:
            best[key] = f
    return {"config": {k: v for k, v in vars(args).items() if k != "output_json"}, "rounds": results,
            "best": list(best.values())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=128, help="requests per burst, all sent at once")
    parser.add_argument("--input-len", type=int, default=512, help="token ids per prompt")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--modes", nargs="+", choices=["plain", "stream"], default=["plain", "stream"])
    parser.add_argument("--rounds", type=int, default=3, help="bursts per (max_tokens, mode)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-trace", action="store_true", help="run the server without APP_TRACE_DIR")
    parser.add_argument("--output-json", help="write the report here too")
    parser.add_argument("server_args", nargs="*", help="after --: flags for `python -m app serve`")
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.input_len < 1 or args.rounds < 1 or min(args.max_tokens) < 0:
        parser.error("--num-requests, --input-len and --rounds must be at least 1, --max-tokens at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = benchmark(args)
    for f in report["best"]:
        print(f"\nbest of {args.rounds}: max_tokens {f['max_tokens']}, {f['mode']}: {f['burst_ms']:.0f} ms "
              f"(floor {f['floor_ms']:.0f} ms)")
        print(stage_table(f))
    text = json.dumps(report)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
