"""The watchdog: an actor that has work and makes no progress for ``--watchdog-timeout`` seconds
has failed, as if it had died.

A hung step, a process stopped with SIGSTOP, a rank stuck in a collective: the process lives,
so the supervisor's exit watch never fires, and every client waits forever. The watchdog reads
two signs of progress that no actor has to send, every ``interval`` seconds, in the supervisor:

- each actor's heartbeat (app/actors/heartbeat.py): busy, and how many pieces of work it
  finished (for the scheduler, its steps);
- each channel's indices (app/ipc/ring.py ``RingGauge``): whether the receiving actor has input
  waiting, and whether it takes any. This catches an actor that was stopped while idle and
  then sent work, which its own heartbeat cannot show.

An actor is stalled while it has work (busy, or unread input) and neither its beats nor any of
its input channels' read indices move. The first actor stalled for ``timeout`` seconds is the
one reported (:class:`ActorStalled`): the earliest stall is the cause, since actors that wait on
it (a scheduler blocked on a full channel to a stopped detokenizer) stall after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import trio

from app.actors.graph import ChannelGraph
from app.actors.heartbeat import HeartbeatBoard
from app.actors.process import ActorDied, ActorProcess
from app.ipc.ring import RingGauge
from app.ipc.segment import map_gauge

DEFAULT_WATCHDOG_TIMEOUT_S = 300.0  # SGLang's default for --watchdog-timeout
MAX_INTERVAL_S = 1.0  # how often the signs are read, at most (a quarter of the timeout when shorter)


class ChannelGauges:
    """Read-only views of the indices of every channel an actor receives on, mapped from the
    graph before its descriptors close; a context manager that unmaps them."""

    def __init__(self, graph: ChannelGraph) -> None:
        self.gauges: dict[str, RingGauge] = {}
        self._receivers: dict[str, str] = {}  # channel name -> the actor that reads it
        self._maps = ExitStack()
        try:
            for channel in graph.channels:
                # lane 0's ingress is the watchdog's own process; a worker lane's ingress is
                # watched for its death only (its trio loop serves HTTP and has no heartbeat)
                if channel.edge.receiver not in ("ingress", "supervisor"):
                    header, gauge = map_gauge(graph.resources[channel.name].spec)
                    self._maps.callback(header.close)
                    self._maps.callback(gauge.release)
                    self.gauges[channel.name] = gauge
                    self._receivers[channel.name] = channel.receiving_actor
        except BaseException:
            self._maps.close()
            raise

    def inputs_of(self, actor: str) -> list[RingGauge]:
        """The gauges of the channels ``actor`` receives on."""
        return [gauge for name, gauge in self.gauges.items() if self._receivers[name] == actor]

    def close(self) -> None:
        self._maps.close()

    def __enter__(self) -> ChannelGauges:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ActorStalled(ActorDied):
    """An actor that had work and made no progress for the watchdog's timeout: a failure of the
    server, reported like a death (its process still runs until the server kills it)."""

    def __init__(self, actor: ActorProcess, stalled_s: float, findings: dict[str, Any]) -> None:
        report = {"kind": "stall", "stalled_s": round(stalled_s, 3), **findings}
        super().__init__(actor.name, None, actor.tail(), report)
        self.summary = f"{actor.title} made no progress for {stalled_s:.1f} s (watchdog)"
        self.args = (self.summary,)
        self.pid = actor.pid


@dataclass
class _Progress:
    """What the watchdog last saw of one actor."""

    marks: tuple[int, ...] = ()  # its beats and the read index of each of its inputs
    seen_at: float = 0.0  # trio time of that sample
    stalled_since: float | None = None  # trio time from which it had work and no mark moved
    findings: dict[str, Any] = field(default_factory=dict)


class Watchdog:
    """Watches ``actors`` through ``board`` and ``gauges`` (see the module docstring)."""

    def __init__(self, timeout: float, actors: Sequence[ActorProcess], board: HeartbeatBoard,
                 gauges: ChannelGauges, *, interval: float | None = None) -> None:
        if not timeout > 0:
            raise ValueError(f"--watchdog-timeout must be positive, got {timeout}")
        self.timeout = timeout
        self.interval = interval if interval is not None else max(0.02, min(MAX_INTERVAL_S, timeout / 4))
        self.actors = list(actors)
        self.board = board
        self.gauges = gauges
        self._progress = {actor.name: _Progress() for actor in self.actors}

    async def wait_for_stall(self) -> ActorStalled:
        """Sample every ``interval`` until an actor has been stalled for ``timeout``; return it."""
        while True:
            await trio.sleep(self.interval)
            stalled = self.check(trio.current_time())
            if stalled is not None:
                return stalled

    def check(self, now: float) -> ActorStalled | None:
        """One sample of every actor at trio time ``now``; the actor stalled longest, once that
        is ``timeout`` or more (None before)."""
        worst: tuple[float, ActorProcess, _Progress] | None = None
        for actor in self.actors:
            progress = self._progress[actor.name]
            marks, findings = self._sample(actor.name)
            has_work = findings["busy"] or any(findings["unread_bytes"].values())
            if has_work and marks == progress.marks:
                if progress.stalled_since is None:
                    progress.stalled_since = progress.seen_at  # unchanged since that sample
                progress.findings = findings
            else:
                progress.stalled_since = None
            progress.marks, progress.seen_at = marks, now
            since = progress.stalled_since
            if since is not None and now - since >= self.timeout and (worst is None or since < worst[0]):
                worst = (since, actor, progress)
        if worst is None:
            return None
        since, actor, progress = worst
        return ActorStalled(actor, now - since, progress.findings)

    def _sample(self, actor: str) -> tuple[tuple[int, ...], dict[str, Any]]:
        pulse = self.board.read(actor)
        inputs = {gauge.name: gauge.indices() for gauge in self.gauges.inputs_of(actor)}
        marks = (pulse.beats, *(indices.read for indices in inputs.values()))
        findings = {"busy": pulse.busy, "beats": pulse.beats,
                    "unread_bytes": {name: indices.unread for name, indices in inputs.items()}}
        return marks, findings
