"""Benchmark: how many streamed tokens per second the HTTP layer can write, without the actors.

On a fast GPU a scheduler step produces a token for every running request every few
milliseconds, and the ingress process (hypercorn, our ASGI app, one SSE chunk per token) must
write them all. This tool measures that path alone: it serves our ASGI app (``make_app``) with
hypercorn in a child process, over a stand-in backend that behaves like the scheduler seen from
the ingress (every ``--step-ms``, one output for each of the streams, delivered in one go, as
the ingress routes a TextBatch), and streams ``--streams`` completions of ``--tokens`` tokens
each with the small HTTP client of bench_intake.py::

    python lab/tools/bench_sse.py [--streams 128] [--tokens 64] [--step-ms 5 2 1] [--rounds 2]

Per level: the steps' own duration (``tokens`` × ``step_ms``, the floor), the burst's duration
(the first request sent → the last stream's end), the ``lag_ms`` between the last step and the
last stream's end (the burst less the steps' own duration: how far the HTTP layer fell behind the stand-in
scheduler), the server's CPU
seconds and its CPU per streamed token, and the answers' errors (every stream must end with
``usage.completion_tokens`` equal to ``--tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for app
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_intake import cpu_seconds, make_bodies, run_round  # noqa: E402

VOCAB = 1024


class LockstepBackend:
    """The Backend for the HTTP layer: every ``step_s`` one output per live request, into the
    unbounded channel each request was submitted with, as the ingress delivers them."""

    def __init__(self, step_s: float) -> None:
        from app.http.backend import ModelCard, ServerState

        self.model = ModelCard(name="lockstep", path="", context_length=4096, vocab_size=VOCAB, architecture="none")
        self.state = ServerState.SERVING
        self.step_s = step_s
        self.live: dict[str, tuple[Any, int, int]] = {}  # rid → (answers channel, made, wanted)
        self.wake = trio.Event()

    async def submit(self, request: Any, answers: Any) -> None:
        self.live[request.rid] = (answers, 0, request.sampling.max_new_tokens)
        self.wake.set()

    async def release(self, rid: str) -> None:
        self.live.pop(rid, None)

    async def run(self) -> None:
        from app.ipc.messages import Finish, FinishReason, TextOutput, Usage, pack_tokens

        token = pack_tokens([7])
        while True:
            if not self.live:
                self.wake = trio.Event()
                await self.wake.wait()
            await trio.sleep(self.step_s)  # the step
            for rid, (answers, made, wanted) in list(self.live.items()):
                made += 1
                final = made >= wanted
                finish = Finish(FinishReason.LENGTH) if final else None
                usage = Usage(512, made) if final or made == 1 else None
                answers.send_nowait(TextOutput(rid, "x", token, finish, usage))
                if final:
                    answers.close()
                    del self.live[rid]
                else:
                    self.live[rid] = (answers, made, wanted)


def serve(sock: socket.socket, step_s: float) -> None:
    """The child: our ASGI app over the lockstep backend, on ``sock``, until SIGTERM."""
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    from app.http.asgi import make_app

    backend = LockstepBackend(step_s)
    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.backlog = 2048  # every connection of the burst waits in the kernel's queue (no SYN retransmits)
    config.accesslog = None

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(backend.run)
            nursery.start_soon(hypercorn_serve, make_app(backend), config)

    trio.run(main)  # until the parent's SIGTERM ends the process


def level(args: argparse.Namespace, step_ms: float) -> list[dict[str, Any]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    port = sock.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        try:
            serve(sock, step_ms / 1e3)
        finally:
            os._exit(0)
    sock.close()
    time.sleep(1.0)  # hypercorn up
    results = []
    try:
        for index in range(args.rounds + 1):  # the first one warms up
            bodies = make_bodies(f"sse/{index}", args.streams, 4, args.tokens, True, VOCAB, "lockstep")
            before = cpu_seconds({"server": pid})["server"]
            start = time.monotonic()
            answers = trio.run(run_round, "127.0.0.1", port, bodies, f"s{index}", True)
            cpu = cpu_seconds({"server": pid})["server"] - before
            if index == 0:
                continue
            errors = sum(a.error is not None or a.completion_tokens != args.tokens for a in answers)
            end = max(a.end for a in answers)
            results.append({"step_ms": step_ms, "round": index, "streams": args.streams, "tokens": args.tokens,
                            "errors": errors, "steps_floor_ms": round(args.tokens * step_ms, 1),
                            "burst_ms": round((end - start) * 1e3, 1),
                            "lag_ms": round((end - start) * 1e3 - args.tokens * step_ms, 1),
                            "server_cpu_s": round(cpu, 3),
                            "cpu_us_per_token": round(cpu / (args.streams * args.tokens) * 1e6, 1)})
            time.sleep(0.3)
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--step-ms", type=float, nargs="+", default=[5.0, 2.0, 1.0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    results = []
    for step_ms in args.step_ms:
        for figures in level(args, step_ms):
            print(f"step {step_ms} ms: {figures['streams']} streams x {figures['tokens']} tokens in "
                  f"{figures['burst_ms']:.0f} ms (steps alone {figures['steps_floor_ms']:.0f} ms), server CPU "
                  f"{figures['server_cpu_s']:.2f} s = {figures['cpu_us_per_token']:.1f} us/token, "
                  f"errors {figures['errors']}", flush=True)
            results.append(figures)
    print(json.dumps({"config": vars(args), "levels": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
