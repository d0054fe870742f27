"""The HTTP front of one lane: the ASGI app over a lane's Ingress, as the supervisor's process and
every ingress worker (app/actors/ingress_worker.py) build it, and the listening sockets they share.

With ``--ingress-workers N`` the supervisor binds the HTTP port once, before it spawns anything,
and every front accepts on that one socket: the kernel hands each new connection to one of the
processes waiting on it, so a busy front takes fewer. A connection stays with the front that
accepted it, and so do its requests: their outputs come back down that front's lane (graph.py).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypercorn.config import Config

from app.http.asgi import make_app
from app.http.openai_adapter import TokenNamer
from app.http.primitives import Request, Responder
from app.http.routes import RouteSettings
from app.http.server import LISTEN_BACKLOG, BindError
from app.http.backend import Backend
from app.ipc.messages import SamplingParams
from app.observability.access_log import AccessLog
from app.observability.http_metrics import CountedHttp, metrics_handler
from app.observability.http_spans import HttpSpans
from app.observability.ingress_metrics import MeteredBackend, ServerMetrics
from app.observability.tracing import ProcessTracing
from app.server_args import ServerArgs


def default_ingress_workers(cores: int) -> int:
    """--ingress-workers when not given: one front on a small machine (the scheduler and the
    clients need the cores), then one per four cores, at most four."""
    return 1 if cores < 8 else min(4, cores // 4)


def bind_http(host: str, port: int) -> list[socket.socket]:
    """The listening sockets of ``host:port`` (hypercorn's way of binding), listening; raises
    BindError when the address cannot be listened on."""
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    try:
        sockets = config.create_sockets().insecure_sockets
        for sock in sockets:
            sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        raise BindError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return list(sockets)


@dataclass
class FrontParts:
    """What a front needs besides its backend, the same in every process."""

    args: ServerArgs
    sampling_defaults: SamplingParams
    token_namer: TokenNamer
    access_log: AccessLog | None
    tracing: ProcessTracing | None = None


def front_app(parts: FrontParts, backend: Backend, trace: Any, metrics: ServerMetrics | None,
              metrics_text: Callable[[Request], Responder] | None = None) -> Any:
    """The ASGI app of one front: ``backend`` metered when ``metrics`` is given; ``GET /metrics``
    answered by ``metrics_text`` where given (a worker serves the supervisor's text), else from
    ``metrics``."""
    args = parts.args
    app: Any = make_app(
        backend if metrics is None else MeteredBackend(backend, metrics),
        keys=args.keys,
        settings=RouteSettings(sampling_defaults=parts.sampling_defaults,
                               priority_scheduling=args.engine.enable_priority_scheduling,
                               default_priority=args.engine.default_priority_value),
        token_namer=parts.token_namer,
        body_read_timeout_s=args.http_read_timeout,
        trace=trace,
        middleware=[] if parts.tracing is None else [HttpSpans(parts.tracing)],
        access_log=parts.access_log,
        metrics=metrics_text if metrics_text is not None else None if metrics is None else metrics_handler(metrics),
    )
    if metrics is not None:
        app = CountedHttp(app, app.paths, metrics)
    return app
