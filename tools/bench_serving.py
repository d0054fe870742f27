"""Benchmark: streaming capacity of the whole serving pipeline, with the embedded tiny model.

Starts ``python -m app serve --port 0`` (stopped, with every process reaped, at the end), then
for each concurrency level runs that many streams of ``POST /generate`` with ``stream: true``
and ``ignore_eos``, each on its own connection, each stream asking for the same number of
tokens; every stream runs ``--rounds`` requests one after another. It measures:

- ``output_tok_s``: output tokens delivered over SSE per second, all streams together, from the
  first request sent to the last stream ended;
- ``ttft_p50_ms``: request sent → first event carrying a token;
- ``token_latency_p50_ms`` / ``token_latency_p99_ms``: for every token, the client's
  time.monotonic() when its event arrived minus ``meta_info.produced_at``, the scheduler's
  time.monotonic() when the step that made it ended. CLOCK_MONOTONIC is system-wide on Linux,
  so the difference is what the detokenizer, the ingress, HTTP and SSE add to a token.

The tiny model's weights are random: this measures the pipeline, not a model. Client and server
share the machine's cores, so the figures include the client's own parsing; ``client_cpu_s``
says how much CPU the client took (at 1.0 per second of ``wall_s`` it was the bottleneck).

    python tools/bench_serving.py [--quick] [--concurrency 1 16 128] [--max-new-tokens 128]

The last line printed is one JSON object: the figures above, keyed by concurrency.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.server_process import ServerProcess  # noqa: E402



# ---------------------------------------------------------------- the client


class _Meta(msgspec.Struct):
    completion_tokens: int = 0  # so far, in a streamed event
    produced_at: float | None = None
    finish_reason: dict[str, Any] | None = None


class _Event(msgspec.Struct):
    """The part of /generate's event the benchmark reads (the text is skipped, not decoded)."""

    meta_info: _Meta


class StreamResult(NamedTuple):
    tokens: int
    ttft_s: float
    token_latencies_s: list[float]  # one per token


_decode_event = msgspec.json.Decoder(_Event).decode


async def stream_once(client: httpx.AsyncClient, prompt: str, max_new_tokens: int) -> StreamResult:
    """One streamed /generate; raises RuntimeError unless it ends with all its tokens."""
    body = {
        "text": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 1.0},
    }
    sent = time.monotonic()
    first: float | None = None
    tokens, latencies, finish = 0, [], None
    buffer = b""
    async with client.stream("POST", "/generate", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"/generate answered {response.status_code}: {(await response.aread())[:200]!r}")
        async for data in response.aiter_raw():
            received = time.monotonic()
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            for raw in events:
                payload = raw.removeprefix(b"data: ")
                if payload == b"[DONE]" or not payload:
                    continue
                meta = _decode_event(payload).meta_info
                new = meta.completion_tokens - tokens
                if new > 0:
                    first = received if first is None else first
                    tokens = meta.completion_tokens
                    if meta.produced_at is not None:
                        latencies.extend([received - meta.produced_at] * new)
                finish = meta.finish_reason or finish
    if finish is None or finish.get("type") != "length" or tokens != max_new_tokens or first is None:
        raise RuntimeError(f"a stream ended with {tokens}/{max_new_tokens} tokens, finish {finish}")
    return StreamResult(tokens, first - sent, latencies)


class LevelResult(NamedTuple):
    streams: int
    requests: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    ttft_p50_ms: float
    token_latency_p50_ms: float
    token_latency_p99_ms: float
    client_cpu_s: float  # this process's CPU time during the level


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


async def run_level(url: str, streams: int, rounds: int, max_new_tokens: int) -> LevelResult:
    """``streams`` concurrent streams, one connection each, ``rounds`` requests apiece."""
    results: list[StreamResult] = []
    clients = [httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=1))
               for _ in range(streams)]
    try:
        for client in clients:  # connect before the clock starts: TTFT is not a TCP handshake
            (await client.get("/health")).raise_for_status()

        async def worker(index: int, client: httpx.AsyncClient) -> None:
            for round_ in range(rounds):
                prompt = f"Stream {index}, round {round_}: tell me a long story about a lighthouse."
                results.append(await stream_once(client, prompt, max_new_tokens))

        start, cpu_start = time.monotonic(), time.process_time()
        async with trio.open_nursery() as nursery:
            for index, client in enumerate(clients):
                nursery.start_soon(worker, index, client)
        wall, cpu = time.monotonic() - start, time.process_time() - cpu_start
    finally:
        for client in clients:
            await client.aclose()
    tokens = sum(r.tokens for r in results)
    latencies = [lat for r in results for lat in r.token_latencies_s]
    if not latencies:
        raise RuntimeError("no event carried meta_info.produced_at")
    return LevelResult(
        streams=streams,
        requests=len(results),
        output_tokens=tokens,
        wall_s=round(wall, 3),
        output_tok_s=round(tokens / wall, 1),
        ttft_p50_ms=round(percentile([r.ttft_s for r in results], 50) * 1e3, 2),
        token_latency_p50_ms=round(percentile(latencies, 50) * 1e3, 3),
        token_latency_p99_ms=round(percentile(latencies, 99) * 1e3, 3),
        client_cpu_s=round(cpu, 3),
    )


async def run_all(url: str, levels: list[int], rounds: int, max_new_tokens: int) -> dict[str, dict[str, Any]]:
    await run_level(url, 1, 1, 8)  # warm the client and the server's paths up
    figures = {}
    for streams in levels:
        result = await run_level(url, streams, rounds, max_new_tokens)
        print(
            f"{streams:>4} streams: {result.output_tok_s:>8.1f} tok/s, TTFT p50 {result.ttft_p50_ms:.1f} ms, "
            f"added latency per token p50 {result.token_latency_p50_ms:.2f} ms, "
            f"p99 {result.token_latency_p99_ms:.2f} ms ({result.requests} requests, {result.wall_s:.1f} s, "
            f"client CPU {result.client_cpu_s:.1f} s)",
            flush=True,
        )
        figures[str(streams)] = result._asdict()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and rounds: a smoke run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 128], help="streams at once")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per stream (default 128; 32 quick)")
    parser.add_argument("--rounds", type=int, default=None, help="requests per stream (default 3; 1 quick)")
    parser.add_argument("server_args", nargs="*", help="after --: more flags for `python -m app serve`")
    args = parser.parse_args()
    max_new_tokens = args.max_new_tokens or (32 if args.quick else 128)
    rounds = args.rounds or (1 if args.quick else 3)
    if max_new_tokens < 1 or rounds < 1 or min(args.concurrency) < 1:
        parser.error("--max-new-tokens, --rounds and --concurrency must be at least 1")

    with ServerProcess(*args.server_args) as server:
        url = server.wait_serving()
        info = httpx.get(f"{url}/server_info").json()
        print(f"server {url}: model {info['args'].get('served_model_name') or 'embedded tiny'}, "
              f"{max_new_tokens} tokens per stream, {rounds} round(s)", flush=True)
        figures = trio.run(run_all, url, args.concurrency, rounds, max_new_tokens)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
