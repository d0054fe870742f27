"""The supervisor's side of the worker fronts (``--ingress-workers``, app/actors/ingress_worker.py):
commands out, metrics in.

Commands are sent without waiting (``send_nowait``): they go out from the paths that stop the
server, which must not block on a worker that is itself stuck or gone; a command that does not fit
is dropped, and such a worker is stopped with the others by SIGTERM, then SIGKILL.
"""

from __future__ import annotations

from typing import Any

import trio

from app.actors.endpoints import Endpoints
from app.actors.process import ActorProcess
from app.http.backend import ServerError
from app.ipc.messages import WorkerCommand, WorkerCommandKind
from app.observability.ingress_metrics import LatestSnapshots, ServerMetrics
from app.observability.logs import get_logger

METRICS_SHARE_INTERVAL_S = 1.0  # how stale a scrape answered by a worker may be, at most (plus its own 0.5 s)


class WorkerFronts:
    """The worker lanes' fronts: their channels with the supervisor, and their processes."""

    def __init__(self, channels: list[Endpoints], actors: list[ActorProcess]) -> None:
        self.channels = channels
        self.actors = actors
        self._commands = [lane.senders["supervisor_to_ingress"] for lane in channels]

    def _send(self, command: WorkerCommand) -> None:
        for channel in self._commands:
            try:
                channel.send_nowait(command)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                if command.kind is not WorkerCommandKind.METRICS:  # the next metrics follow in a second
                    get_logger().warning("a worker front missed a command", command=command.kind.value,
                                         error=repr(exc))

    def fail(self, error: ServerError) -> None:
        """Every worker answers its open requests with ``error`` and stops."""
        for actor in self.actors:
            actor.stopping = True
        self._send(WorkerCommand(WorkerCommandKind.FAIL, error.message, error.status_code, error.error_type))

    def drain(self) -> None:
        """Every worker lets its requests finish (--shutdown-timeout), then exits 0."""
        for actor in self.actors:
            actor.stopping = True  # its exit is expected
        self._send(WorkerCommand(WorkerCommandKind.DRAIN))

    def running(self) -> int:
        """How many worker fronts still run."""
        return sum(actor.popen.poll() is None for actor in self.actors)

    async def collect_metrics(self, snapshots: LatestSnapshots) -> None:
        """Keep every worker's snapshots (its own and its lane actors') beside everyone's."""

        async def collect(channel: Any) -> None:
            try:
                async for snapshot in channel:
                    snapshots.keep(snapshot)
            except trio.BrokenResourceError:
                pass  # the worker is gone: the supervisor reports why

        async with trio.open_nursery() as nursery:
            for lane in self.channels:
                nursery.start_soon(collect, lane.receivers["ingress_to_supervisor"])

    async def share_metrics(self, metrics: ServerMetrics) -> None:
        """Every METRICS_SHARE_INTERVAL_S: the whole server's /metrics text to every worker, which
        answers a scrape that lands on it with it."""
        while True:
            text, _ = metrics.exposition(None)
            self._send(WorkerCommand(WorkerCommandKind.METRICS, payload=text))
            await trio.sleep(METRICS_SHARE_INTERVAL_S)
