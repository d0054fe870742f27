"""The supervisor: owns every actor process for the whole life of the server.

It is a trio nursery: one task per child drains its stderr, one watches its exit; the
children's ready lines are awaited in start order, each with a deadline. After start-up it
never stops watching. Any child exit that was not asked for is a failure of the whole
server: the ``on_failure`` hook runs first (the ingress answers every in-flight request and
writes the crash dump), then every other child is stopped, then :class:`ActorDied`
propagates so that ``python -m app serve`` exits non-zero and a process manager restarts it.

Stopping a child follows ``trio.run_process``: SIGTERM, a deadline, a warning, SIGKILL, in a
shielded scope, so that cancellation of the supervisor still stops (and reaps) everything.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from app.actors.process import EXIT_PEER_GONE, ActorDied, ActorProcess, ActorStartError
from app.observability.logs import get_logger

FailureHook = Callable[[ActorDied], Awaitable[None]]
PEER_GONE_GRACE_S = 0.5


def first_failure(group: BaseExceptionGroup) -> ActorDied | ActorStartError | None:
    """The supervision error inside a (nested) nursery group, if any: the one to report."""
    for exc in group.exceptions:
        if isinstance(exc, (ActorDied, ActorStartError)):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = first_failure(exc)
            if found is not None:
                return found
    return None


class Supervisor:
    """Watch ``actors`` (already spawned, in start order) until cancelled or one dies."""

    def __init__(
        self,
        actors: Sequence[ActorProcess],
        *,
        ready_timeout: float = 300.0,
        stop_grace: float = 5.0,
        failure_deadline: float = 5.0,
        on_failure: FailureHook | None = None,
    ) -> None:
        self.actors = list(actors)
        self.ready_timeout = ready_timeout
        self.stop_grace = stop_grace
        self.failure_deadline = failure_deadline
        self.on_failure = on_failure
        self._failure_claimed = trio.Event()  # one actor's death is the one reported
        self._log = get_logger()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Start-up, then supervision. ``task_status.started(ready_infos)`` once all are ready.

        Raises ActorStartError when a child fails to start, ActorDied when one dies later.
        Every child is stopped and reaped before this returns or raises.
        """
        try:
            await self._run(task_status)
        except BaseExceptionGroup as group:
            failure = first_failure(group)
            if failure is None:
                raise
            raise failure from None

    async def _run(self, task_status: Any) -> None:
        async with trio.open_nursery() as nursery:
            for actor in self.actors:
                nursery.start_soon(self._drain, actor)
            try:
                infos = {}
                for actor in self.actors:
                    infos[actor.name] = await actor.wait_ready(self.ready_timeout)
                    info = infos[actor.name]
                    self._log.info(
                        "actor ready",
                        target=actor.title,
                        target_pid=actor.pid,
                        startup_s=info.get("startup_s"),
                        rss_mb=info.get("rss_mb"),
                    )
                async with trio.open_nursery() as watchers:
                    for actor in self.actors:
                        watchers.start_soon(self._watch, actor)
                    task_status.started(infos)
            finally:
                await self.stop_all()

    async def _drain(self, actor: ActorProcess) -> None:
        # Shielded: the stderr of a stopping child is still read to its end (its last lines
        # are often the interesting ones). It ends when the child exits, which stop_all ensures.
        with trio.CancelScope(shield=True):
            await actor.drain_stderr()

    async def _watch(self, actor: ActorProcess) -> None:
        try:
            await actor.watch()
        except ActorDied as died:
            if died.returncode == EXIT_PEER_GONE:
                # It only followed a peer that died: give the peer's watcher the chance to
                # report the root cause (it usually notices within milliseconds).
                with trio.move_on_after(PEER_GONE_GRACE_S):
                    await self._failure_claimed.wait()
            if self._failure_claimed.is_set():
                return  # another actor's death is the failure being reported
            self._failure_claimed.set()
            self._log.error("actor died", target=actor.title, returncode=died.returncode)
            for other in self.actors:
                other.stopping = True  # from here on, their exits are expected
            if self.on_failure is not None:
                with trio.CancelScope(shield=True) as scope:
                    scope.deadline = trio.current_time() + self.failure_deadline
                    await self.on_failure(died)
            raise

    async def stop_all(self) -> None:
        """Stop every child, all at once (each: SIGTERM, grace, SIGKILL). Shielded."""
        with trio.CancelScope(shield=True):
            for actor in reversed(self.actors):
                actor.stopping = True
            async with trio.open_nursery() as nursery:
                for actor in self.actors:
                    nursery.start_soon(actor.stop, self.stop_grace)

    def close(self) -> None:
        """Release descriptors; kills anything still running (never leaves a process behind)."""
        for actor in self.actors:
            actor.kill_now()
            actor.close()
