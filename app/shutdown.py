"""How the server stops: the exception that asks for it, and the one deadline every layer keeps.

The server nests its layers, HTTP inside the ingress inside the supervisor, and a shutdown
unwinds them innermost first: HTTP drains its connections, the ingress stops routing, the
supervisor stops the actors. They share one :class:`ShutdownDeadline` (``--shutdown-timeout``):
the first layer to stop starts its clock, and every layer after it is cut off at that same
moment, so the whole shutdown takes at most that long, however the time divides between the
layers (as hypercorn's graceful timeout is one deadline for its server).

A SIGTERM first drains (:func:`drain`): the requests in flight have ``--shutdown-timeout`` to
finish while new ones are refused, and only then does the deadline above start.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable

import trio

DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
DRAIN_POLL_S = 0.02  # how often a drain looks whether the last request has ended


class ServerStopping(Exception):
    """A shutdown was asked for (SIGINT or SIGTERM): its own exception, never a KeyboardInterrupt,
    so that the server exits 0 once every layer inside has stopped.

    The first signal drains (:func:`drain`): the requests in flight finish, by
    ``--shutdown-timeout``, while new ones are refused; a second one stops at once."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"{signal_name} received")
        self.signal_name = signal_name


class ServerQuit(Exception):
    """SIGQUIT reached the server: it writes a crash dump and stops as for a crash (exit 1)."""


class ShutdownDeadline:
    """The moment by which every layer of a stopping server is done (trio's clock).

    Handed to each layer that has something to stop. :meth:`start` fixes the deadline on its
    first call, ``timeout`` seconds from then, and returns that same deadline on every later
    call: the layers stop one after another, and all of them by then.
    """

    def __init__(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        if not timeout >= 0:
            raise ValueError(f"the shutdown timeout must be at least 0 seconds, got {timeout}")
        self.timeout = timeout
        self._deadline: float | None = None  # None until the shutdown starts

    @property
    def started(self) -> bool:
        """Whether a layer has started stopping."""
        return self._deadline is not None

    def start(self) -> float:
        """The deadline: ``timeout`` seconds from the first call, the same at every later one."""
        if self._deadline is None:
            self._deadline = trio.current_time() + self.timeout
        return self._deadline


async def drain(in_flight: Callable[[], int], timeout: float, signals: AsyncIterator[int]) -> str:
    """Wait until ``in_flight()`` is 0 (``"drained"``), ``timeout`` seconds have passed
    (``"timed out"``), or one more signal arrives on ``signals`` (its name): how it ended."""
    ended = ["timed out"]
    with trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for signum in signals:
                    ended[0] = signal.Signals(signum).name
                    nursery.cancel_scope.cancel()

            nursery.start_soon(on_signal)
            while in_flight():
                await trio.sleep(DRAIN_POLL_S)
            ended[0] = "drained"
            nursery.cancel_scope.cancel()
    return ended[0]
