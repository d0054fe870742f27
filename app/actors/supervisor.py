"""The supervisor: owns every actor process for the whole life of the server.

:meth:`Supervisor.supervising` is the outer layer of the server: one task per child drains its
stderr and, once all are ready, one watches its exit; it never stops watching. A child that
exits unasked is a failure of the whole server, reported as a value by
:meth:`Supervisor.wait_for_death` (not raised from a watcher), so that its owner can answer
every client first and then raise it up through the layers nested inside.

Leaving the block stops every child the way ``trio.run_process`` does on cancellation:
SIGTERM, the shutdown deadline, a warning, SIGKILL, in a shielded scope, so that the
children are stopped and reaped however the block ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from app.actors.failure_report import is_own_failure
from app.actors.process import ActorDied, ActorProcess
from app.observability.logs import get_logger
from app.shutdown import ShutdownDeadline

# How long an actor that only followed a peer (EXIT_PEER_GONE, or exit 0 with no failure of its
# own: its input ended) waits for another actor's own failure to be reported instead: the root
# cause is the one worth reporting. An actor that reported a failure but is still exiting
# (writing its crash dump) is waited for up to FAILING_EXIT_WAIT_S more.
PEER_GONE_GRACE_S = 0.5
FAILING_EXIT_WAIT_S = 2.0

ReadyInfos = dict[str, dict[str, Any]]


class Supervisor:
    """Start-up, watching and stopping of ``actors`` (already spawned, in start order)."""

    def __init__(
        self,
        actors: Sequence[ActorProcess],
        *,
        ready_timeout: float = 300.0,
        shutdown: ShutdownDeadline | None = None,
    ) -> None:
        self.actors = list(actors)
        self.ready_timeout = ready_timeout  # seconds for each actor, in turn, to report ready
        self.shutdown = shutdown if shutdown is not None else ShutdownDeadline()
        self._death: ActorDied | None = None  # the first actor that exited unasked
        self._death_known = trio.Event()  # set once _death is
        self._log = get_logger()

    @asynccontextmanager
    async def supervising(self) -> AsyncIterator[ReadyInfos]:
        """Wait for each actor's ready line, in start order, and yield their ready infos (by
        name); then watch them for as long as the block runs.

        Raises ActorStartError (inside trio's exception group) when an actor exits or times
        out before it is ready. Every actor is stopped and reaped before the block is left.
        """
        async with trio.open_nursery() as nursery:
            for actor in self.actors:
                nursery.start_soon(self._drain, actor)
            try:
                infos = await self._wait_ready()
                async with trio.open_nursery() as watchers:
                    for actor in self.actors:
                        watchers.start_soon(self._watch, actor)
                    try:
                        yield infos
                    finally:
                        watchers.cancel_scope.cancel()  # before stopping: one waiter per pidfd
            finally:
                await self._stop_all()

    async def wait_for_death(self) -> ActorDied:
        """The first actor that exited unasked, once one did (the root cause, when one actor's
        death made its peers exit too)."""
        await self._death_known.wait()
        if self._death is None:
            raise RuntimeError("the death event was set without a death")
        return self._death

    async def _wait_ready(self) -> ReadyInfos:
        infos: ReadyInfos = {}
        for actor in self.actors:
            info = infos[actor.name] = await actor.wait_ready(self.ready_timeout)
            self._log.info(
                "actor ready",
                target=actor.title,
                target_pid=actor.pid,
                startup_s=info.get("startup_s"),
                rss_mb=info.get("rss_mb"),
            )
        return infos

    async def _drain(self, actor: ActorProcess) -> None:
        # Shielded: the stderr of a stopping child is still read to its end (its last lines
        # are often the interesting ones). It ends when the child exits, which _stop_all ensures.
        with trio.CancelScope(shield=True):
            await actor.drain_stderr()

    async def _watch(self, actor: ActorProcess) -> None:
        try:
            await actor.watch()
        except ActorDied as died:
            if not died.own_failure:
                # It only followed a peer: give the peer's watcher the chance to report the
                # root cause (it usually notices within milliseconds).
                with trio.move_on_after(PEER_GONE_GRACE_S):
                    await self._death_known.wait()
                if any(is_own_failure(other.report) for other in self.actors if other is not actor):
                    with trio.move_on_after(FAILING_EXIT_WAIT_S):  # one is still failing: wait for it
                        await self._death_known.wait()
            if self._death_known.is_set():
                return  # another actor's death is the failure being reported
            self._log.error("actor died", target=actor.title, returncode=died.returncode)
            for other in self.actors:
                other.stopping = True  # from here on, their exits are expected
            self._death = died
            self._death_known.set()

    async def _stop_all(self) -> None:
        """Stop every child at once, each by the shutdown deadline. Shielded."""
        deadline = self.shutdown.start()
        with trio.CancelScope(shield=True):
            for actor in self.actors:
                actor.stopping = True
            async with trio.open_nursery() as nursery:
                for actor in self.actors:
                    nursery.start_soon(actor.stop, deadline)
