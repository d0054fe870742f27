"""Serving the ASGI app with hypercorn on trio, in the caller's nursery.

Shutdown is graceful when ``shutdown`` is set: hypercorn stops accepting, lets in-flight
requests finish for up to ``graceful_timeout_s``, then cancels them, and the app's lifespan
ends last. Cancelling the caller's scope stops everything at once. Open streams end only when
the backend ends them, so the ingress fails its in-flight requests (ServerError) before it
sets ``shutdown``; each client then gets an error event and ``data: [DONE]``.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import trio
from hypercorn.config import Config
from hypercorn.trio import serve


class HttpBinding(NamedTuple):
    """Where the server listens (the real port when it was asked for port 0)."""

    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


# Connections the kernel completes before hypercorn accepts them (capped by net.core.somaxconn).
# hypercorn's default of 100 is too few for a burst: the kernel drops the SYNs past it, and
# each of those clients waits for its SYN retransmit (1 s on Linux) before it is even read;
# 128 requests sent at once had their last answer after ~1.05 s instead of ~0.13 s on a 2-core
# box (docs/benchmarks.md, "Intake and output path of a burst"). 2048 is uvicorn's default.
LISTEN_BACKLOG = 2048


def _config(host: str, port: int, graceful_timeout_s: float) -> Config:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.backlog = LISTEN_BACKLOG
    config.graceful_timeout = graceful_timeout_s
    config.accesslog = None  # request logs come from our middleware, not hypercorn's format
    config.errorlog = logging.getLogger("hypercorn.error")  # through our logging set-up
    return config


async def serve_http(
    app: Any,
    host: str,
    port: int,
    *,
    shutdown: trio.Event | None = None,
    graceful_timeout_s: float = 5.0,
    task_status: trio.TaskStatus[HttpBinding] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``host:port`` until ``shutdown`` is set (or the caller cancels).

    Reports the bound address through ``task_status`` once it accepts connections. Raises
    OSError when the address cannot be bound.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    if graceful_timeout_s < 0:
        raise ValueError(f"graceful_timeout_s must be >= 0, got {graceful_timeout_s}")
    trigger = shutdown.wait if shutdown is not None else None
    async with trio.open_nursery() as nursery:
        config = _config(host, port, graceful_timeout_s)
        urls: list[str] = await nursery.start(partial(serve, app, config, shutdown_trigger=trigger))
        bound = urlsplit(urls[0])
        task_status.started(HttpBinding(bound.hostname or host, bound.port or port))
