"""How the server stops: the exception that asks for it, and the one deadline every layer keeps.

The server nests its layers, HTTP inside the ingress inside the supervisor, and a shutdown
unwinds them innermost first: HTTP drains its connections, the ingress stops routing, the
supervisor stops the actors. They share one :class:`ShutdownDeadline` (``--shutdown-timeout``):
the first layer to stop starts its clock, and every layer after it is cut off at that same
moment, so the whole shutdown takes at most that long, however the time divides between the
layers (as hypercorn's graceful timeout is one deadline for its server).
"""

from __future__ import annotations

import trio

DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


class ServerStopping(Exception):
    """A shutdown was asked for (SIGINT or SIGTERM): its own exception, never a KeyboardInterrupt,
    so that the server exits 0 once every layer inside has stopped."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"{signal_name} received")
        self.signal_name = signal_name


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

    def start(self) -> float:
        """The deadline: ``timeout`` seconds from the first call, the same at every later one."""
        if self._deadline is None:
            self._deadline = trio.current_time() + self.timeout
        return self._deadline
