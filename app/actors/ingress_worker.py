"""An ingress worker: the HTTP front of lane k ≥ 1 (``--ingress-workers``), a process of its own.

It serves the same routes as the supervisor's process (app/front.py), on the listening socket the
supervisor bound and passed down, through an Ingress over its own lane's channels: its own
tokenizer and detokenizer, and the one scheduler (graph.py). So the HTTP parsing, the SSE
writing and the routing of outputs, the ingress's CPU-bound work, spread over the fronts.

The supervisor commands it over ``supervisor_to_ingress`` (WorkerCommand):

- ``fail``: the server failed: every open request is answered with the message (the root cause
  the supervisor found), then the worker stops;
- ``drain``: a SIGTERM: /health and new requests get 503, idle connections close, the requests in
  flight have --shutdown-timeout to finish (then they get a 503), then the worker exits 0;
- ``metrics``: the whole server's /metrics text, which a scrape that lands here is answered with.

With --enable-metrics it sends its own metrics and its lane's actors' snapshots to the
supervisor (``ingress_to_supervisor``) every ``METRICS_INTERVAL_S``; the supervisor's /metrics
adds them up with everyone's.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import msgspec
import trio

from app.actors.child import ReadyCallback, run_actor
from app.actors.endpoints import Endpoints
from app.actors.ingress import Ingress
from app.actors.queue_gate import QueueGate
from app.engine.config import DEFAULT_MAX_RUNNING_REQUESTS
from app.front import FrontParts, front_app
from app.http.backend import ModelCard, ServerError, ServerState
from app.http.openai_adapter import token_id_name
from app.http.primitives import Request, Responder
from app.http.server import serving_http
from app.ipc.messages import MetricsSnapshot, WorkerCommand, WorkerCommandKind
from app.observability import metrics as metric_families
from app.observability.access_log import AccessLog
from app.observability.http_metrics import TextResponse
from app.observability.ingress_metrics import ServerMetrics
from app.observability.logs import get_logger
from app.observability.request_log import IngressRequestLog
from app.observability.tracing import process_tracing
from app.server_args import parse_server_args
from app.shutdown import ShutdownDeadline
from app.text.generation_config import sampling_defaults
from app.text.tokenizer import Tokenizer

METRICS_INTERVAL_S = 0.5
_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class WorkerMetricsText:
    """``GET /metrics`` on a worker: the supervisor's latest text of the whole server."""

    def __init__(self) -> None:
        self.text = b""

    def __call__(self, request: Request) -> Responder:
        return TextResponse(self.text, _PROMETHEUS_TEXT)


async def _send_metrics(ingress: Ingress, recorder: ServerMetrics, channel: Any, actor: str) -> None:
    """Every METRICS_INTERVAL_S: this front's own metrics and its lane actors' latest snapshots."""
    while True:
        await trio.sleep(METRICS_INTERVAL_S)
        own = MetricsSnapshot(actor, tuple(metric_families.families_of(recorder.own)))
        for snapshot in [own, *ingress.snapshots.by_actor.values()]:
            await channel.send(snapshot)


async def _obey(commands: Any, ingress: Ingress, draining: trio.Event, metrics_text: WorkerMetricsText,
                timeout: float) -> None:
    """Follow the supervisor's commands until one ends the worker (or the supervisor closes)."""
    log = get_logger()
    async for command in commands:
        assert isinstance(command, WorkerCommand)
        if command.kind is WorkerCommandKind.METRICS:
            metrics_text.text = command.payload
        elif command.kind is WorkerCommandKind.FAIL:
            ingress.fail_all(ServerError(command.message, command.status_code, command.error_type))
            return
        elif command.kind is WorkerCommandKind.DRAIN:
            log.info("draining", requests_in_flight=ingress.unfinished, timeout_s=timeout)
            ingress.set_state(ServerState.STOPPING)
            draining.set()
            with trio.move_on_after(timeout):
                while ingress.unfinished:
                    await trio.sleep(0.05)
            ingress.fail_all(ServerError("The server is shutting down.", 503, "ServiceUnavailableError"))
            return


async def ingress_worker_main(config: dict[str, Any], ready: ReadyCallback) -> None:
    args = parse_server_args(config["argv"], environ=config["keys"])
    name = config["name"]
    model = msgspec.convert(config["model"], ModelCard)
    model_path = model.path
    tokenizer = Tokenizer.from_dir(model_path) if (Path(model_path) / "tokenizer.json").is_file() else None
    engine = args.engine
    gate = QueueGate.for_limits(engine.max_queued_requests, engine.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
                                engine.enable_priority_scheduling)
    listeners = [socket.socket(fileno=fd) for fd in config["listen_fds"]]
    access_log = AccessLog.for_level(args.observability.log_level_http or args.log_level)
    with (
        Endpoints("ingress", config["channels"]) as channels,
        process_tracing(args.observability, name) as tracing,
    ):
        ingress = Ingress(channels, model, args.to_dict(), gate, IngressRequestLog.for_settings(args.observability),
                          name=name)
        recorder = (ServerMetrics(model.name, ingress.snapshots, priority_scheduling=engine.enable_priority_scheduling)
                    if args.observability.enable_metrics else None)
        metrics_text = WorkerMetricsText()
        parts = FrontParts(args, sampling_defaults(model_path),
                           (lambda token_id: tokenizer.decode([token_id])) if tokenizer else token_id_name,
                           access_log, tracing)
        app = front_app(parts, ingress, ingress.trace, recorder, metrics_text if recorder is not None else None)
        draining = trio.Event()
        async with (
            ingress.routing(),
            serving_http(app, args.host, args.port, deadline=ShutdownDeadline(args.shutdown_timeout),
                         max_connections=args.max_connections, access_log=access_log,
                         on_refusal=None if recorder is None else recorder.connection_refused,
                         draining=draining, sockets=listeners),
            trio.open_nursery() as nursery,
        ):
            await ingress.warm_up()
            ingress.set_state(ServerState.SERVING)
            if recorder is not None:
                nursery.start_soon(_send_metrics, ingress, recorder, channels.senders["ingress_to_supervisor"], name)
            ready({})
            await _obey(channels.receivers["supervisor_to_ingress"], ingress, draining, metrics_text,
                        args.shutdown_timeout)
            nursery.cancel_scope.cancel()


def main() -> None:
    run_actor(sys.argv[-1].removeprefix("app::"), ingress_worker_main)


if __name__ == "__main__":
    main()
