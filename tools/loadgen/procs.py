"""Client processes: a level's requests split over several processes, so that the client measures
the server and not its own event loop.

One Python process parsing SSE streams costs tens of microseconds of CPU per chunk (httpx, h11,
trio, JSON): measured on the H200, one process driving 256 streams used 2.24 s of CPU in a 2.76 s
run, and its numbers were the client's. With ``--client-procs N`` the parent starts N worker
processes (multiprocessing's spawn context: a fresh interpreter each, no forked trio state), each
with its own trio loop and httpx client; for each level the parent

1. splits the level's requests round-robin over the workers (:func:`split_level`): the arrival
   schedule is drawn once in the parent, so the level's aggregate schedule is the one a single
   process would follow, and ``--max-concurrency C`` becomes C // n (+1 for the first C % n)
   per process;
2. sends each worker its share, waits until every worker has it, then sends one start time
   (a ``time.perf_counter()`` reading: CLOCK_MONOTONIC, one clock for every process of the
   machine); each worker sends its requests at start + offset;
3. merges the workers' per-request records, and each worker's CPU seconds (``time.process_time``
   over its share) for the CPU share.

One process (``--client-procs 1``) runs the level in the parent itself, with no worker.
Workers are always ended: the parent stops, then terminates, then kills them when it leaves its
``with`` block (an error, Ctrl-C); a worker whose parent vanished reads EOF on its pipe and ends,
and on Linux the kernel kills it with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, NamedTuple

import httpx
import trio

from loadgen.stream import Outcome, RequestSpec, Share, Target, run_share

# The documented rule of ``--client-procs auto``: one process per this many streams that may be in
# flight at once, at most half of the machine's cores (the other half for the server, when it runs
# here). 64: at the H200's ~45k out tok/s over 256 streams one process used ~80 % of a core, so 64
# streams a process keeps each near 20-50 % at such rates.
STREAMS_PER_CLIENT_PROC = 64
# A client process above this share of a core may be the bottleneck: the report warns.
CLIENT_BOUND_SHARE = 0.8
# The share of a core that the warning's suggested process count aims at.
CLIENT_TARGET_SHARE = 0.5
START_LEAD_S = 0.02  # the start time the parent gives is this far ahead, once every worker is armed
READY_TIMEOUT_S = 60.0  # a worker that has not started by then is an error
STOP_TIMEOUT_S = 5.0  # then terminate, then kill


def auto_client_procs(streams: int, cores: int) -> int:
    """``--client-procs auto``: one process per STREAMS_PER_CLIENT_PROC streams in flight, at least
    one, at most half of ``cores``."""
    return max(1, min(math.ceil(streams / STREAMS_PER_CLIENT_PROC), cores // 2))


def suggested_client_procs(cpu_s: float, duration_s: float) -> int:
    """The processes that would have kept each near CLIENT_TARGET_SHARE of a core."""
    return max(1, math.ceil(cpu_s / (duration_s * CLIENT_TARGET_SHARE))) if duration_s > 0 else 1


def split_level(specs: list[RequestSpec], offsets: list[float], max_concurrency: int | None,
                procs: int) -> list[Share]:
    """The level's requests round-robin over at most ``procs`` processes (no more than there are
    requests, or slots under the cap); the cap split as evenly as it goes."""
    n = max(1, min(procs, len(specs), max_concurrency or procs))
    shares = []
    for i in range(n):
        cap = None if not max_concurrency else max_concurrency // n + (1 if i < max_concurrency % n else 0)
        shares.append(Share(specs[i::n], offsets[i::n], cap))
    return shares


class ClientConfig(NamedTuple):
    """How every client process talks to the server (the API key travels in ``headers``, over
    the pipe only)."""

    base_url: str
    headers: dict[str, str]
    timeout: float
    max_connections: int | None  # None: no limit


def make_client(config: ClientConfig) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=config.max_connections)
    return httpx.AsyncClient(base_url=config.base_url, timeout=config.timeout, limits=limits, headers=config.headers)


class ShareResult(NamedTuple):
    outcomes: list[Outcome]
    cpu_s: float  # the process's CPU seconds while it sent its share


class LocalClients:
    """One client process: the parent runs the level's one share on its own client."""

    count = 1

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def run(self, target: Target, shares: list[Share]) -> list[ShareResult]:
        (share,) = shares
        cpu_start = time.process_time()
        outcomes = await run_share(self._client, target, share, time.perf_counter())
        return [ShareResult(outcomes, time.process_time() - cpu_start)]


class ClientPool:
    """``count`` worker processes; ``run`` sends a level's shares through them. A context manager:
    leaving it ends every worker."""

    def __init__(self, count: int, config: ClientConfig) -> None:
        context = multiprocessing.get_context("spawn")
        self.count = count
        self._workers: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
        try:
            for index in range(count):
                parent_end, child_end = context.Pipe()
                process = context.Process(target=worker_main, args=(child_end, config),
                                          name=f"bench-client-{index}", daemon=True)
                process.start()
                child_end.close()
                self._workers.append((process, parent_end))
        except BaseException:
            self.close(graceful=False)
            raise

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close(graceful=kind is None)

    async def wait_ready(self) -> None:
        """Every worker started and reached the server once (RuntimeError otherwise)."""
        try:
            with trio.fail_after(READY_TIMEOUT_S):
                await self._gather("ready", range(self.count))
        except trio.TooSlowError:
            raise RuntimeError(f"the client processes did not start within {READY_TIMEOUT_S:g} s") from None

    async def run(self, target: Target, shares: list[Share]) -> list[ShareResult]:
        used = range(len(shares))
        for index, share in zip(used, shares):
            self._send(index, ("share", target, share))
        await self._gather("armed", used)
        start_at = time.perf_counter() + START_LEAD_S
        for index in used:
            self._send(index, ("go", start_at))
        results = await self._gather("done", used)
        return [ShareResult(outcomes, cpu_s) for outcomes, cpu_s in results]

    def _send(self, index: int, message: tuple[Any, ...]) -> None:
        try:
            self._workers[index][1].send(message)
        except OSError as exc:
            raise RuntimeError(f"client process {index} is gone ({exc!r})") from None

    async def _gather(self, kind: str, indices: range) -> list[Any]:
        """Each worker's next message, which must be ``kind``; its payload, in worker order.
        RuntimeError naming every worker that failed or ended (once all have answered)."""
        payloads: list[Any] = [None] * len(indices)
        failures: list[str] = []

        async def receive(slot: int, index: int) -> None:
            connection = self._workers[index][1]
            try:
                message = await trio.to_thread.run_sync(connection.recv, abandon_on_cancel=True)
            except (EOFError, OSError):
                failures.append(f"client process {index} ended unexpectedly "
                                f"(exit code {self._workers[index][0].exitcode})")
                return
            if message[0] != kind:
                failures.append(f"client process {index} failed: {message[1]}")
                return
            payloads[slot] = message[1] if len(message) > 1 else None

        async with trio.open_nursery() as nursery:
            for slot, index in enumerate(indices):
                nursery.start_soon(receive, slot, index)
        if failures:
            raise RuntimeError("; ".join(failures))
        return payloads

    def close(self, graceful: bool = True) -> None:
        """Stop every worker: ask (``graceful``: between levels; after an error or Ctrl-C a worker
        may be sending, so straight to SIGTERM), then terminate, then kill; each one joined."""
        for process, connection in self._workers:
            if not graceful:
                process.terminate()
                continue
            try:
                connection.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process, connection in self._workers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join()
            connection.close()
        self._workers.clear()


# ---------------------------------------------------------------- in the worker


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when its parent ends."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_main(connection: Connection, config: ClientConfig) -> None:
    """A client process: serve shares from the parent until it says stop or goes away."""
    _die_with_parent()
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the parent ended before the line above
        return
    try:
        trio.run(_serve, connection, config)
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass  # Ctrl-C reaches the whole process group; the parent reaps us
    except Exception as exc:  # noqa: BLE001 - told to the parent, which fails the run
        try:
            connection.send(("failed", repr(exc)))
        except OSError:
            pass
    finally:
        connection.close()


async def _serve(connection: Connection, config: ClientConfig) -> None:
    async with make_client(config) as client:
        try:  # the first request of a process pays for its imports and connection setup
            await client.get("/v1/models")
        except httpx.HTTPError:
            pass
        connection.send(("ready",))
        while True:
            message = await trio.to_thread.run_sync(connection.recv, abandon_on_cancel=True)
            if message[0] == "stop":
                return
            _, target, share = message
            connection.send(("armed",))
            _, start_at = await trio.to_thread.run_sync(connection.recv, abandon_on_cancel=True)
            cpu_start = time.process_time()
            outcomes = await run_share(client, target, share, start_at)
            cpu_s = time.process_time() - cpu_start
            connection.send(("done", (outcomes, cpu_s)))
