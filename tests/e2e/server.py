"""End-to-end test helpers around app.server_process: real servers, reaped orphans."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from app.server_process import ServerProcess as _ServerProcess
from app.server_process import alive, children_of, wait_until

__all__ = ["ServerProcess", "alive", "become_subreaper", "children_of", "reap", "serving",
           "tool_args_with_shared_gpu_pool", "wait_until"]

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned grandchildren (actors of a SIGKILLed server) are re-parented to us, so the
    tests can check that they died and reap them (no zombies left behind)."""
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


# Servers of parallel test workers share one GPU: --mem-fraction-static counts every process's
# memory as used, so the first server's pool (85 % of the device) would leave the others none.
# A fixed pool checks only what is free.
SHARED_GPU_POOL_TOKENS = 65536
_MEMORY_FLAGS = ("--max-total-tokens", "--mem-fraction-static")


def shares_a_gpu() -> bool:
    """Whether this test process is one of several pytest-xdist workers on a CUDA machine."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) < 2:
        return False
    import torch

    return torch.cuda.is_available()


def with_shared_gpu_pool(args: tuple[str, ...]) -> tuple[str, ...]:
    """``args`` with a fixed KV pool where workers share a GPU and no memory flag is given."""
    if any(a.split("=")[0] in _MEMORY_FLAGS for a in args) or not shares_a_gpu():
        return args
    return (*args, "--max-total-tokens", str(SHARED_GPU_POOL_TOKENS))


def tool_args_with_shared_gpu_pool(args: tuple[str, ...]) -> tuple[str, ...]:
    """A tool's command line (``tool flags -- server flags``) whose launched server gets the fixed
    pool of :func:`with_shared_gpu_pool`; unchanged when the tool drives a running server."""
    if "--base-url" in args:
        return args
    if "--" not in args:
        extra = with_shared_gpu_pool(())
        return (*args, "--", *extra) if extra else args
    cut = args.index("--")
    return (*args[:cut + 1], *with_shared_gpu_pool(args[cut + 1:]))


class ServerProcess(_ServerProcess):
    """A server whose embedded model lives in the test session's cache directory (and whose KV
    pool is fixed where test workers share a GPU: :func:`with_shared_gpu_pool`)."""

    def __init__(self, *args: str, cache_dir: Path, env: dict[str, str] | None = None, tail_lines: int = 2000) -> None:
        super().__init__(*with_shared_gpu_pool(args), env={"APP_CACHE_DIR": str(cache_dir), **(env or {})},
                         tail_lines=tail_lines)

    def stop(self, *, graceful_timeout: float = 10.0) -> None:
        actors = set(self.actor_pids().values()) | set(self.started_actors.values())
        super().stop(graceful_timeout=graceful_timeout)
        for pid in actors:  # orphans re-parented to us: reap them
            wait_until(lambda: not alive(pid), timeout=5)
            reap(pid)


@contextmanager
def serving(*args: str, cache_dir: Path) -> Iterator[str]:
    """A server started with ``args``, serving for the block (its URL), stopped and reaped after."""
    server = ServerProcess(*args, cache_dir=cache_dir)
    try:
        server.wait_serving()
        yield server.url
    finally:
        server.stop()


def stream_in_thread(url: str, body: dict, events: list[str], started: threading.Event, *,
                     headers: dict[str, str] | None = None,
                     on_end: Callable[[], None] | None = None) -> threading.Thread:
    """POST ``body`` (a streamed /v1/completions request) from a started daemon thread: every SSE
    data line is appended to ``events`` (a transport error as one ``transport error: ...`` entry);
    ``started`` is set at the first line and again at the end; ``on_end`` runs at the end."""

    def read() -> None:
        try:
            with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body,
                                                                headers=headers) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
        except httpx.HTTPError as exc:
            events.append(f"transport error: {exc!r}")
        started.set()
        if on_end is not None:
            on_end()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread
