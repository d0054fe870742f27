"""Starting, watching and stopping one actor process.

Spawning happens from the main thread before ``trio.run`` starts (:func:`spawn_actor`): the
child's ``PR_SET_PDEATHSIG`` follows the thread that forked it, and trio's worker threads
retire after idling, so a child forked from one of them would be killed while its parent
lives on. Everything after the fork (reading the ready line, draining stderr, noticing the
exit, stopping) is trio code on :class:`ActorProcess`.

A child's command line ends with its title (``python -m app.actors.scheduler
app::scheduler_TP0``), so ``ps`` shows which process is which (argv[0] stays the real
interpreter: Python finds its prefix and virtual environment from it); its configuration arrives on stdin as JSON (not argv: it holds descriptors and
arguments that do not belong in ``ps``); it writes one JSON line on stdout once ready and
logs on stderr, which the supervisor drains continuously.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from app.actors.failure_report import is_own_failure, parse_report
from app.observability.logs import LineWriter, actor_title, get_logger, stderr_writer

STDERR_TAIL_LINES = 40
STDERR_END_WAIT_S = 0.3  # after an exit, how long the last stderr lines (the failure report) may take
# An actor exits with this code when it stopped because a peer process died (PeerDiedError):
# a consequence, not a cause, so the supervisor reports the peer's death instead.
EXIT_PEER_GONE = 86


class ActorStartError(RuntimeError):
    """An actor did not report ready: it exited, or timed out. Carries the end of its stderr."""


class ActorDied(RuntimeError):
    """An actor exited while the server was running (for any reason, with any code).

    ``report`` is what the actor said of its own failure before exiting (failure_report.py):
    the message names the exception's type or the signal, never the exception's text (that
    may quote a prompt, and this message reaches every client); the dump holds the rest.
    """

    def __init__(self, actor: str, returncode: int | None, stderr_tail: str,
                 report: dict[str, Any] | None = None) -> None:
        self.summary = f"{actor_title(actor)} {_how_it_ended(returncode, report)}"  # one line, for clients
        super().__init__(self.summary + (f"; last stderr lines:\n{stderr_tail}" if stderr_tail else ""))
        self.actor = actor
        self.returncode = returncode
        self.stderr_tail = stderr_tail
        self.report = report

    @property
    def own_failure(self) -> bool:
        """Whether this actor failed by itself (killed by a signal, a non-zero exit other than
        EXIT_PEER_GONE, or a reported exception or signal), rather than only following a peer."""
        if is_own_failure(self.report):
            return True
        return self.returncode is not None and self.returncode not in (0, EXIT_PEER_GONE)


def _how_it_ended(returncode: int | None, report: dict[str, Any] | None) -> str:
    if returncode is not None and returncode < 0:
        return "was killed by signal " + signal.Signals(-returncode).name
    kind = (report or {}).get("kind")
    if kind == "exception":
        return f"raised {report['type']} (exit code {returncode})"  # type: ignore[index]
    if kind == "signal":
        return f"stopped on {report.get('signal')} (exit code {returncode})"  # type: ignore[union-attr]
    return f"exited with code {returncode}"


@dataclass(frozen=True)
class ActorLaunch:
    """How to start one actor: its name, its module (run with ``-m``), its configuration."""

    name: str  # e.g. "scheduler_TP0": the title is app::<name>
    module: str  # a module with a main() that calls app.actors.child.run_actor
    config: bytes  # JSON, written to the child's stdin
    pass_fds: tuple[int, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class ActorProcess:
    """A started actor: the trio-side handle that the supervisor watches."""

    name: str
    popen: subprocess.Popen[bytes]
    pidfd: int
    stderr_tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES))
    stopping: bool = False  # set once we asked it to stop: its exit is then expected
    ready_info: dict[str, Any] = field(default_factory=dict)
    reports: list[dict[str, Any]] = field(default_factory=list)  # its failure reports (failure_report.py)
    stderr_ended: trio.Event = field(default_factory=trio.Event)  # its stderr reached its end

    @property
    def report(self) -> dict[str, Any] | None:
        """Its first report of a failure of its own, else its first report, else None."""
        own = [r for r in self.reports if is_own_failure(r)]
        return (own or self.reports or [None])[0]

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def title(self) -> str:
        return actor_title(self.name)

    def tail(self) -> str:
        return "\n".join(self.stderr_tail)

    async def drain_stderr(self, forward_to: LineWriter | None = None) -> None:
        """Forward the child's stderr lines to ours, keeping the last few for error messages.

        Runs until the child closes its stderr (it exited). Never lets the pipe fill up. Each
        line goes out whole through this process's one writer (app.observability.logs says why).
        """
        writer = forward_to if forward_to is not None else stderr_writer()
        assert self.popen.stderr is not None
        stream = trio.lowlevel.FdStream(os.dup(self.popen.stderr.fileno()))
        pending = b""
        try:
            async with stream:
                while True:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        break
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for raw in lines:
                        self._take_line(raw.decode("utf-8", "replace"), writer)
            if pending:
                self._take_line(pending.decode("utf-8", "replace"), writer)
        finally:
            self.stderr_ended.set()

    def _take_line(self, line: str, writer: LineWriter) -> None:
        """A failure report is kept (not logged: the child logged it in words); any other line
        is forwarded whole and kept in the tail."""
        report = parse_report(line)
        if report is not None:
            if len(self.reports) < 8:
                self.reports.append(report)
            return
        self.stderr_tail.append(line)
        writer.forward(line, source=self.title, pid=self.pid)

    async def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Wait for the child's ready line; raise ActorStartError with its stderr tail otherwise."""
        assert self.popen.stdout is not None
        stream = trio.lowlevel.FdStream(os.dup(self.popen.stdout.fileno()))
        line = b""
        async with stream:
            with trio.move_on_after(timeout) as scope:
                while not line.endswith(b"\n"):
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    line += chunk
        if scope.cancelled_caught:
            raise ActorStartError(f"{self.title} did not report ready within {timeout:.0f} s" + self._tail_suffix())
        if not line.endswith(b"\n"):
            code = await self.wait_exit()
            await trio.sleep(0.05)  # let the stderr drain catch the last lines
            raise ActorStartError(f"{self.title} exited with code {code} during start-up" + self._tail_suffix())
        try:
            self.ready_info = msgspec.json.decode(line)["ready"]
        except (msgspec.DecodeError, KeyError, TypeError) as exc:
            raise ActorStartError(f"{self.title} wrote an invalid ready line {line[:200]!r}") from exc
        return self.ready_info

    def _tail_suffix(self) -> str:
        tail = self.tail()
        return f"; last stderr lines:\n{tail}" if tail else " (no stderr output)"

    async def wait_exit(self) -> int:
        """Wait (without a thread) until the child exits; returns its exit code."""
        if self.popen.returncode is None:
            await trio.lowlevel.wait_readable(self.pidfd)
        return self.popen.wait()

    async def watch(self) -> None:
        """Return only when the child exited as asked; raise ActorDied for any other exit."""
        code = await self.wait_exit()
        if not self.stopping:
            await trio.sleep(0.05)  # let the stderr drain catch the last lines
            with trio.move_on_after(STDERR_END_WAIT_S):  # and the failure report, written just before
                await self.stderr_ended.wait()
            raise ActorDied(self.name, code, self.tail(), self.report)

    async def stop(self, deadline: float) -> int:
        """SIGTERM, wait until ``deadline`` (trio's clock), then a warning and SIGKILL; always
        reaps. Shielded: a cancelled caller still stops the child."""
        self.stopping = True
        with trio.CancelScope(shield=True):
            if self.popen.returncode is None:
                self._signal(signal.SIGTERM)
                with trio.move_on_at(deadline):
                    return await self.wait_exit()
                get_logger().warning("actor did not stop in time; killing it", target=self.title)
                self._signal(signal.SIGKILL)
            return await self.wait_exit()

    def _signal(self, sig: signal.Signals) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        """Kill the child if it still runs (synchronously: the last resort, outside trio), reap
        it, and release the pidfd and pipes. Never leaves a process behind."""
        self.stopping = True
        if self.popen.poll() is None:
            self._signal(signal.SIGKILL)
            self.popen.wait()
        for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if pipe is not None:
                pipe.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def spawn_actor(launch: ActorLaunch) -> ActorProcess:
    """Start an actor process. Call from the main thread, outside trio (see module doc)."""
    env = dict(os.environ)
    env.update(launch.env)
    env["APP_PARENT_PID"] = str(os.getpid())
    env["APP_SPAWNED_AT"] = repr(time.monotonic())  # the child reports its start-up time from this
    popen = subprocess.Popen(
        [sys.executable, "-m", launch.module, actor_title(launch.name)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=launch.pass_fds,
        env=env,
        start_new_session=False,  # stay in our process group: the supervisor decides on SIGINT
    )
    try:
        pidfd = os.pidfd_open(popen.pid)
        assert popen.stdin is not None
        popen.stdin.write(launch.config)
        popen.stdin.close()
    except BaseException:
        popen.kill()
        popen.wait()
        raise
    return ActorProcess(launch.name, popen, pidfd)


@contextmanager
def spawned_actors(launches: Iterable[ActorLaunch]) -> Iterator[list[ActorProcess]]:
    """Spawn each actor, in order (from the main thread, outside trio: see the module doc).

    Leaving the block closes every one spawned (:meth:`ActorProcess.close`: killed if it
    still runs, reaped, descriptors released), also when a later spawn fails: the one place
    an actor process is let go. The supervisor stops them gracefully before that.
    """
    actors: list[ActorProcess] = []
    try:
        for launch in launches:
            actors.append(spawn_actor(launch))
        yield actors
    finally:
        for actor in actors:
            actor.close()
