"""Soak test: a mixed, hostile workload against a real server, then the invariants checked.

    python tools/soak.py [--seconds 60] [--concurrency 64] [-- server flags...]

Starts ``python -m app serve`` (with a small KV pool by default, so that retraction and
eviction happen), then runs ``--concurrency`` client tasks for ``--seconds``. Each request picks
at random: /generate or the OpenAI routes, streamed or not, greedy or sampled, stop strings,
n > 1, a client that hangs up early, an /abort_request from another task, an invalid body. At
the end it checks what must always hold: every request got an answer (a status and, when
streamed, a final event), 4xx only for the invalid ones, no 5xx, no traceback in the server's
log, nothing left used or locked in the KV pool and all of it free after /flush_cache, and no
process left once the server stopped. The last line is a JSON summary; exit 1 on a violation.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.server_process import ServerProcess, alive, wait_until  # noqa: E402

MODEL = "tiny-llama-v1"
WORDS = "the quick brown fox jumps over a lazy dog while 日本 and émigré friends sing 🙂".split()


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 60)))


async def one_request(client: httpx.AsyncClient, rng: random.Random, counts: Counter, rid: int,
                      nursery: trio.Nursery) -> None:
    kind = rng.choice(["generate", "completions", "chat", "invalid"])
    stream = rng.random() < 0.5
    hang_up = stream and rng.random() < 0.15
    params = {"max_new_tokens": rng.randrange(1, 64), "temperature": rng.choice([0.0, 0.7, 1.0]),
              "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.3:
        params["stop"] = [rng.choice(WORDS)[:2] or "a"]
    if rng.random() < 0.2:  # biased rows join and leave batches of unbiased ones (ids every vocabulary has)
        params["logit_bias"] = {str(rng.randrange(256)): rng.uniform(-100.0, 100.0) for _ in range(rng.randrange(1, 4))}
    headers = {"X-Request-Id": f"soak-{rid}"}
    if kind == "generate":
        url, body = "/generate", {"text": prompt(rng), "sampling_params": params, "stream": stream}
    elif kind == "invalid":
        url, body = "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -5}
    else:
        body = {"model": MODEL, "max_tokens": params["max_new_tokens"], "temperature": params["temperature"],
                "stream": stream, "n": rng.choice([1, 1, 1, 2, 3]), "ignore_eos": params["ignore_eos"]}
        for name in ("stop", "logit_bias"):
            if name in params:
                body[name] = params[name]
        if kind == "chat":
            url, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt(rng)}]
        else:
            url, body["prompt"] = "/v1/completions", prompt(rng)
    if rng.random() < 0.05:  # someone else aborts it shortly
        async def abort_later() -> None:
            await trio.sleep(rng.random() * 0.2)
            await client.post("/abort_request", json={"rid": f"soak-{rid}"})

        nursery.start_soon(abort_later)
    try:
        if not stream:
            response = await client.post(url, json=body, headers=headers)
            counts[f"status_{response.status_code}"] += 1
            if kind == "invalid" and response.status_code != 400:
                counts["violation_invalid_not_400"] += 1
            if kind != "invalid" and response.status_code >= 400:
                counts[f"violation_{kind}_{response.status_code}"] += 1
            return
        async with client.stream("POST", url, json=body, headers=headers) as response:
            counts[f"status_{response.status_code}"] += 1
            ended = False
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    ended = True
                elif line.startswith('data: {"error"'):
                    message = json.loads(line[6:])["error"].get("message", "")
                    counts[f"stream_error: {message[:60]}"] += 1
                if hang_up:
                    counts["hung_up"] += 1
                    return
            if response.status_code == 200 and not ended:
                counts["violation_stream_without_done"] += 1
    except httpx.HTTPError as exc:
        counts[f"violation_transport_{type(exc).__name__}"] += 1


async def workload(url: str, seconds: float, concurrency: int, seed: int) -> Counter:
    counts: Counter = Counter()
    deadline = trio.current_time() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        async with trio.open_nursery() as nursery:
            async def worker(index: int) -> None:
                rng = random.Random(seed * 1000 + index)
                n = 0
                while trio.current_time() < deadline:
                    await one_request(client, rng, counts, index * 1_000_000 + n, nursery)
                    counts["requests"] += 1
                    n += 1

            for index in range(concurrency):
                nursery.start_soon(worker, index)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("server_args", nargs="*", help="after --: flags for `python -m app serve`")
    options = parser.parse_args()
    server_args = options.server_args or ["--max-total-tokens", "2048", "--max-running-requests", "48"]
    violations: list[str] = []
    started = time.monotonic()
    with ServerProcess(*server_args) as server:
        url = server.wait_serving()
        actors = list(server.actor_pids().values())
        counts = trio.run(workload, url, options.seconds, options.concurrency, options.seed)

        def pool() -> dict:
            return httpx.get(f"{url}/server_info", timeout=30).json()["scheduler"]["kv_pool"]

        if not wait_until(lambda: pool()["used"] == 0 and pool()["locked"] == 0, timeout=30, interval=0.5):
            violations.append(f"KV still used after the workload: {pool()}")
        httpx.post(f"{url}/flush_cache", timeout=30)
        if not wait_until(lambda: pool()["free"] == pool()["total"], timeout=30, interval=0.5):
            violations.append(f"KV not all free after a flush: {pool()}")
    log = server.log()
    if "Traceback" in log:
        violations.append("a traceback in the server's log")
    if any(alive(pid) for pid in actors):
        violations.append("an actor outlived the server")
    violations += [f"{key}: {value}" for key, value in counts.items() if key.startswith("violation")]
    summary = {"seconds": round(time.monotonic() - started, 1), "counts": dict(sorted(counts.items())),
               "violations": violations}
    print(json.dumps(summary))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
