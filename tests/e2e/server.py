"""Starting a real `python -m app serve` for end-to-end tests, and watching what it leaves."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36
ROOT = Path(__file__).resolve().parents[2]


def become_subreaper() -> None:
    """Orphaned grandchildren (actors of a SIGKILLed server) are re-parented to us, so
    the tests can check they died and reap them (no zombies left behind)."""
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def children_of(pid: int) -> list[int]:
    """Direct children (the actors) of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


class ServerProcess:
    """One server; ``url`` once it reports serving; stderr kept in ``lines``."""

    def __init__(self, *args: str, cache_dir: Path, env: dict[str, str] | None = None) -> None:
        environment = dict(os.environ, APP_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT))
        environment.update(env or {})
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--port", "0", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
            cwd=ROOT,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        self.started_actors: dict[str, int] = {}  # recorded once serving: to reap them later
        self._serving = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)  # drains stderr: never blocks the server
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.lines.append(line.rstrip("\n"))
            match = re.search(r"serving url=(http://\S+)", line)
            if match:
                self.url = match.group(1)
                self._serving.set()

    def wait_serving(self, timeout: float = 120.0) -> str:
        if not self._serving.wait(timeout):
            raise AssertionError("server did not start:\n" + self.log())
        assert self.url is not None
        self.started_actors = self.actor_pids()
        return self.url

    def log(self) -> str:
        return "\n".join(self.lines)

    def actor_pids(self) -> dict[str, int]:
        pids = {}
        for pid in children_of(self.popen.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
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

    def stop(self) -> None:
        """Kill whatever is left (test teardown), actors included, and reap everything."""
        pids = set(self.actor_pids().values()) | set(self.started_actors.values())
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            wait_until(lambda: not alive(pid), timeout=5)
            reap(pid)
        self._reader.join(timeout=5)
        if self.popen.stderr is not None:
            self.popen.stderr.close()


def wait_until(predicate, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
