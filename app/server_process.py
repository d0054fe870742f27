"""``python -m app serve`` as a child process, for tools and tests that need a real server.

It drains the server's stderr in a thread (a full pipe would block the server), learns the URL
from the ``serving url=...`` log line (so ``--port 0`` works), finds the actor processes, and
stops everything it started: SIGTERM first (a clean shutdown), SIGKILL past a deadline, then
any actor that outlived the server. Use it as a context manager.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SERVING = re.compile(r"serving url=(http://\S+)")
_SERVING_JSON = re.compile(r'"url":\s*"(http://[^"]+)"')  # with --log-json: the line whose event is "serving"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


def wait_until(predicate, timeout: float, interval: float = 0.02) -> bool:  # noqa: ANN001 - any callable
    """Poll ``predicate`` until true or ``timeout`` seconds; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def _serving_url(line: str) -> str | None:
    """The URL of the server's ``serving`` log line (human or JSON); None for any other line."""
    if match := _SERVING.search(line):
        return match.group(1)
    if '"event":"serving"' in line and (match := _SERVING_JSON.search(line)):
        return match.group(1)
    return None


class ServerProcess:
    """One server: ``wait_serving()`` gives its URL; ``lines`` holds the end of its stderr."""

    def __init__(self, *args: str, env: Mapping[str, str] | None = None, tail_lines: int = 2000) -> None:
        # The repository first; keep what the caller's path adds (a bundle of wheels, say).
        inherited = os.environ.get("PYTHONPATH")
        environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *([inherited] if inherited else [])]))
        environment.update(env or {})
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", *(() if "--port" in args else ("--port", "0")), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
            cwd=ROOT,
        )
        self.lines: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.url: str | None = None
        self.started_actors: dict[str, int] = {}  # recorded once serving: to check and reap later
        self._serving = threading.Event()
        # A thread, not trio: callers are plain scripts and tests; it only drains a pipe.
        self._reader = threading.Thread(target=self._drain, name="server-stderr", daemon=True)
        self._reader.start()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _drain(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.lines.append(line.rstrip("\n"))
            if self.url is None and (url := _serving_url(line)):
                self.url = url
                self._serving.set()

    def wait_serving(self, timeout: float = 180.0) -> str:
        """The URL once the server is healthy; RuntimeError with its stderr if it never is."""
        deadline = time.monotonic() + timeout
        while not self._serving.wait(0.2):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start:\n" + self.log())
        assert self.url is not None
        self.started_actors = self.actor_pids()
        return self.url

    def log(self) -> str:
        return "\n".join(self.lines)

    def actor_pids(self) -> dict[str, int]:
        """The actors by name (``scheduler_TP0``...), read from their command lines."""
        pids = {}
        for pid in children_of(self.popen.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            for part in cmdline:
                if part.startswith(b"app::"):
                    pids[part.decode().removeprefix("app::")] = pid
        return pids

    def signal(self, sig: signal.Signals) -> None:
        self.popen.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        code = self.popen.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return code

    def stop(self, *, graceful_timeout: float = 30.0) -> None:
        """SIGTERM, SIGKILL past ``graceful_timeout``; then make sure no actor outlives it."""
        actors = set(self.actor_pids().values()) | set(self.started_actors.values())
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=graceful_timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        for pid in actors:  # they die with the server (PDEATHSIG); make sure of it
            if not wait_until(lambda: not alive(pid), timeout=5):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._reader.join(timeout=5)
        if self.popen.stderr is not None:
            self.popen.stderr.close()
