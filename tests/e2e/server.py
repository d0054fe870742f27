"""End-to-end test helpers around app.server_process: real servers, reaped orphans."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from app.server_process import ServerProcess as _ServerProcess
from app.server_process import alive, children_of, wait_until

__all__ = ["ServerProcess", "alive", "become_subreaper", "children_of", "reap", "wait_until"]

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


class ServerProcess(_ServerProcess):
    """A server whose embedded model lives in the test session's cache directory."""

    def __init__(self, *args: str, cache_dir: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(*args, env={"APP_CACHE_DIR": str(cache_dir), **(env or {})})

    def stop(self, *, graceful_timeout: float = 10.0) -> None:
        actors = set(self.actor_pids().values()) | set(self.started_actors.values())
        super().stop(graceful_timeout=graceful_timeout)
        for pid in actors:  # orphans re-parented to us: reap them
            wait_until(lambda: not alive(pid), timeout=5)
            reap(pid)
