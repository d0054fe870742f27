"""``python -m app serve``: the supervisor process (ingress + HTTP) and its three actors.

Order of events:

1. Parse and check the arguments; resolve the model (the embedded tiny one by default).
2. Create the channel graph and spawn the tokenizer, scheduler and detokenizer from this,
   the main thread, before trio starts (see app.actors.process for why).
3. Under trio, the layers nest: the supervisor waits until every actor reports ready; inside
   it, the ingress routes the actors' messages; inside that, HTTP serves. A warm-up request
   goes through all four actors, then the server reports healthy.
4. SIGINT/SIGTERM drains: /health and new requests answer 503, idle connections close, the
   requests in flight finish (by ``--shutdown-timeout``, then they get an error event); then the
   layers stop innermost first (HTTP, the ingress, the actors get SIGTERM), by one deadline;
   exit 0. A second signal stops at once. An actor dying, or stalling past
   ``--watchdog-timeout``, or a SIGQUIT: every open request is answered with an error, a crash
   dump is written, the layers stop; exit 1. A failure to start: exit 1 with the actor's stderr
   in the message. docs/faults.md tells it all.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import trio

from app.actors.endpoints import Endpoints
from app.actors.graph import ChannelGraph
from app.actors.heartbeat import HeartbeatBoard
from app.actors.ingress import Ingress
from app.actors.queue_gate import QueueGate
from app.actors.process import ActorDied, ActorLaunch, ActorProcess, ActorStartError, spawned_actors
from app.actors.supervisor import Supervisor
from app.actors.watchdog import ChannelGauges, Watchdog
from app.engine.config import DEFAULT_MAX_RUNNING_REQUESTS
from app.engine.model_config import ModelConfig
from app.errors import find_exception
from app.http.openai_adapter import token_id_name
from app.http.backend import ModelCard, ServerError, ServerState
from app.ipc.messages import SamplingParams
from app.http.auth import ADMIN_API_KEY_ENV, API_KEY_ENV
from app.http.server import FILE_RESERVE, BindError, raise_file_limit, serving_http
from app.actors.fronts import WorkerFronts
from app.actors.graph import lane_actor
from app.front import FrontParts, bind_http, default_ingress_workers, front_app
from app.observability.access_log import AccessLog
from app.observability.crash_dump import DumpReason, prepare_dump_folder
from app.observability.ingress_metrics import ServerMetrics
from app.observability.live_evidence import gather_evidence
from app.observability.logs import actor_title, configure_logging, get_logger
from app.observability.native_traces import native_traces, remove_empty_traces
from app.observability.server_dump import ServerDumper
from app.observability.tracing import ProcessTracing, process_tracing
from app.observability.request_log import IngressRequestLog
from app.server_args import ServerArgs, parse_server_args
from app.shutdown import ServerQuit, ServerStopping, ShutdownDeadline, drain
from app.text.generation_config import sampling_defaults
from app.text.tokenizer import Tokenizer

EXIT_OK = 0
EXIT_FAILED = 1


def _child_env(threads: int) -> dict[str, str]:
    """Thread settings for a child: torch and the tokenizers library read these at import."""
    value = str(threads)
    return {
        "OMP_NUM_THREADS": value,
        "MKL_NUM_THREADS": value,
        "OMP_WAIT_POLICY": "PASSIVE",  # idle OpenMP threads sleep instead of spinning on shared cores
        "RAYON_NUM_THREADS": value,
        "TOKENIZERS_PARALLELISM": "false",
    }


ACTOR_NAMES = ("tokenizer", "scheduler_TP0", "detokenizer")


def lane_actor_names(lanes: int) -> list[str]:
    """The actors the watchdog watches through heartbeats: every lane's tokenizer and
    detokenizer and the scheduler (a worker lane's ingress is watched for its death only)."""
    return [*ACTOR_NAMES, *(lane_actor(role, lane) for lane in range(1, lanes) for role in ("tokenizer", "detokenizer"))]


@dataclass
class FrontLaunch:
    """What an ingress worker needs from the supervisor besides its channels."""

    argv: list[str]
    keys: dict[str, str]  # the keys as environment entries: they reach the worker by its stdin only
    model: ModelCard
    listen_fds: tuple[int, ...]


def _launches(args: ServerArgs, model_path: str, context_len: int, vocab_size: int, graph: ChannelGraph,
              board: HeartbeatBoard, front: FrontLaunch) -> list[ActorLaunch]:
    """Lane 0's tokenizer, the scheduler, lane 0's detokenizer, then each worker lane's
    tokenizer and detokenizer, then the worker fronts (they warm up through the others)."""
    common = {"log_level": args.log_level, "log_json": args.log_json, "model_path": model_path,
              "observability": args.observability.to_config(), "crash_dump_folder": args.crash_dump_folder}
    # Leave a core to the other three actors: torch threads that spin-wait on every core
    # starve the ingress and detokenizer (16 streams went from 4,500 to 109 tokens/s on 2 cores).
    threads = args.scheduler_threads or max(1, len(os.sched_getaffinity(0)) - 1)
    engine_config = args.engine_config(model_path)
    engine_dict = {k: getattr(engine_config, k) for k in engine_config.__dataclass_fields__}
    engine_dict["context_length"] = context_len
    lanes = graph.lanes

    def specs(role: str, lane: int) -> dict[str, Any]:
        return {name: msgspec.to_builtins(spec) for name, spec in graph.specs_for(role, lane).items()}

    def beat(name: str) -> dict[str, Any]:
        return {"heartbeat": board.config_for(name)}  # for the watchdog

    def tokenizer(lane: int) -> ActorLaunch:
        name = lane_actor("tokenizer", lane)
        return ActorLaunch(
            name, "app.actors.tokenizer",
            msgspec.json.encode({**common, **beat(name), "channels": specs("tokenizer", lane),
                                 "context_len": context_len, "vocab_size": vocab_size,
                                 "allow_auto_truncate": engine_config.allow_auto_truncate}),
            (*graph.fds_for("tokenizer", lane), board.fd), _child_env(1))

    def detokenizer(lane: int) -> ActorLaunch:
        name = lane_actor("detokenizer", lane)
        return ActorLaunch(
            name, "app.actors.detokenizer",
            msgspec.json.encode({**common, **beat(name), "channels": specs("detokenizer", lane)}),
            (*graph.fds_for("detokenizer", lane), board.fd), _child_env(1))

    def ingress_worker(lane: int) -> ActorLaunch:
        name = lane_actor("ingress", lane)
        return ActorLaunch(
            name, "app.actors.ingress_worker",
            msgspec.json.encode({**common, "name": name, "channels": specs("ingress", lane), "argv": front.argv,
                                 "keys": front.keys, "model": msgspec.to_builtins(front.model),
                                 "listen_fds": list(front.listen_fds)}),
            (*graph.fds_for("ingress", lane), *front.listen_fds), _child_env(1))

    scheduler = ActorLaunch(
        "scheduler_TP0", "app.actors.scheduler",
        msgspec.json.encode({**common, **beat("scheduler_TP0"), "lanes": [specs("scheduler", k) for k in range(lanes)],
                             "engine": engine_dict, "threads": threads}),
        (*(fd for k in range(lanes) for fd in graph.fds_for("scheduler", k)), board.fd), _child_env(threads))
    workers = range(1, lanes)
    return [tokenizer(0), scheduler, detokenizer(0), *(launch for k in workers for launch in (tokenizer(k), detokenizer(k))),
            *(ingress_worker(k) for k in workers)]


def _connection_cap(wanted: int, log: Any) -> int:
    """--max-connections, lowered (with a warning) where the open-file limit cannot fit it."""
    limit = raise_file_limit(wanted + FILE_RESERVE)
    if limit >= wanted + FILE_RESERVE:
        return wanted
    cap = max(1, limit - FILE_RESERVE)
    log.warning("--max-connections lowered to fit the open-file limit", wanted=wanted, max_connections=cap,
                file_limit=limit)
    return cap


def _forget_keys_in_environment(argv: list[str], log: Any) -> None:
    """The children never see the keys; a key given as a flag shows in ps: say so."""
    for name in (API_KEY_ENV, ADMIN_API_KEY_ENV):
        os.environ.pop(name, None)
    flags = [flag for flag in ("--api-key", "--admin-api-key") if any(a.split("=")[0] == flag for a in argv)]
    if flags:
        log.warning("a key given on the command line is visible to every user in ps; "
                    f"prefer ${API_KEY_ENV} and ${ADMIN_API_KEY_ENV}", flags=flags)


class Server:
    """The trio side of the supervisor process: its layers, nested in the order they stop.

    ``server ⊃ supervisor ⊃ ingress ⊃ HTTP``: HTTP serves inside the ingress, which routes
    inside the supervisor, which owns the actors. Beside them, the shutdown triggers wait for a
    signal or an actor's death; the first answers every open request, then raises
    (ServerStopping or ActorDied), which cancels the layers; each stops gracefully, innermost
    first, all by one deadline (``--shutdown-timeout``).
    """

    def __init__(
        self,
        args: ServerArgs,
        actors: list[ActorProcess],
        endpoints: Endpoints,
        model: ModelCard,
        defaults: SamplingParams,
        tokenizer: Tokenizer | None,
        tracing: ProcessTracing | None = None,
        progress: tuple[HeartbeatBoard, ChannelGauges] | None = None,
        workers: list[Endpoints] | None = None,
        listening: list[socket.socket] | None = None,
    ) -> None:
        self.args = args
        self.workers = WorkerFronts(workers or [], [actor for actor in actors if actor.name.startswith("ingress_")])
        self.listening = listening  # bound before the actors were spawned (None: serve_http binds)
        self.tracing = tracing  # --enable-trace: the ingress's root span of every HTTP request
        self.sampling_defaults = defaults
        # Logprobs name each token by its text, as OpenAI's do (token ids without a tokenizer).
        self.token_namer = (lambda token_id: tokenizer.decode([token_id])) if tokenizer else token_id_name
        self.shutdown = ShutdownDeadline(args.shutdown_timeout)
        engine = args.engine
        gate = QueueGate.for_limits(engine.max_queued_requests,
                                    engine.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
                                    engine.enable_priority_scheduling)
        self.ingress = Ingress(endpoints, model, args.to_dict(), gate, IngressRequestLog.for_settings(args.observability))
        self.metrics = (ServerMetrics(model.name, self.ingress.snapshots,
                                      priority_scheduling=engine.enable_priority_scheduling)
                        if args.observability.enable_metrics else None)
        self.supervisor = Supervisor(actors, ready_timeout=args.startup_timeout, shutdown=self.shutdown)
        self.dumper = ServerDumper(args.crash_dump_folder, args.to_dict(), actors, self.ingress.pending,
                                   args.observability.log_requests_level)
        # --watchdog-timeout: an actor that has work and makes no progress fails the server
        watched = [actor for actor in actors if actor not in self.workers.actors]  # the fronts have no heartbeat
        self.watchdog = None if progress is None else Watchdog(args.watchdog_timeout, watched, *progress)
        self.draining = trio.Event()  # set by a first SIGTERM: HTTP refuses new connections, closes idle ones
        self.log = get_logger()
        self.max_connections = _connection_cap(args.max_connections, self.log)
        self.access_log = AccessLog.for_level(args.observability.log_level_http or args.log_level)

    async def run(self) -> int:
        """Serve until a signal (exit code 0) or a failure (1); returns once every layer stopped."""
        try:
            async with trio.open_nursery() as server:
                await server.start(self._stop_on_signal)
                await server.start(self._fail_on_sigquit)
                server.start_soon(self._fail_on_death)
                server.start_soon(self._fail_on_stall)
                await self._serve()
        except BaseExceptionGroup as group:
            return self._exit_code(group)
        raise RuntimeError("the server stopped without a reason")  # not reached: _serve serves until cancelled

    async def _serve(self) -> None:
        """The layers, outermost first; serves until cancelled."""
        metrics = self.metrics
        parts = FrontParts(self.args, self.sampling_defaults, self.token_namer, self.access_log, self.tracing)
        app = front_app(parts, self.ingress, self.ingress.trace, metrics)
        async with (
            self.supervisor.supervising(),
            self.ingress.routing(),
            serving_http(app, self.args.host, self.args.port, deadline=self.shutdown,
                         max_connections=self.max_connections, access_log=self.access_log,
                         on_refusal=None if metrics is None else metrics.connection_refused,
                         draining=self.draining, sockets=self.listening) as binding,
            trio.open_nursery() as fronts,
        ):
            if metrics is not None and self.workers.channels:
                fronts.start_soon(self.workers.collect_metrics, self.ingress.snapshots)
                fronts.start_soon(self.workers.share_metrics, metrics)
            await self.ingress.warm_up()
            self.ingress.set_state(ServerState.SERVING)
            self.log.info("serving", url=binding.url, model=self.ingress.model.name,
                          ingress_workers=1 + len(self.workers.channels))
            await trio.sleep_forever()

    async def _stop_on_signal(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """SIGINT or SIGTERM: drain (while serving), answer what is left with a 503, then raise
        ServerStopping. Draining: /health and new requests get 503, idle connections close, the
        requests in flight have --shutdown-timeout to finish; a second signal ends it at once."""
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            name = signal.Signals(await signals.__anext__()).name
            if self.ingress.state is ServerState.SERVING:
                in_flight = self.ingress.unfinished
                self.log.info("signal received: draining", signal=name, requests_in_flight=in_flight,
                              timeout_s=self.args.shutdown_timeout)
                self.ingress.set_state(ServerState.STOPPING)
                self.draining.set()
                self.workers.drain()  # each drains its own requests, then exits
                ended = await drain(lambda: self.ingress.unfinished + self.workers.running(),
                                    self.args.shutdown_timeout, signals)
                self.log.info("drain ended: shutting down", how=ended, requests_cut_short=self.ingress.unfinished)
            else:
                self.log.info("signal received: shutting down", signal=name)
            self.shutdown.start()
            stopping = ServerError("The server is shutting down.", 503, "ServiceUnavailableError")
            self.ingress.fail_all(stopping)
            self.workers.fail(stopping)
            raise ServerStopping(name)

    async def _fail_on_sigquit(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """SIGQUIT: answer every open request with a 500, ask the actors for their stacks and the
        scheduler for its view, write the crash dump, then raise ServerQuit (exit 1)."""
        with trio.open_signal_receiver(signal.SIGQUIT) as signals:
            task_status.started()
            await signals.__anext__()
            self.log.error("SIGQUIT received: writing a crash dump and stopping")
            actors = self.supervisor.actors
            for actor in actors:
                actor.stopping = True  # their exits are expected from here on (a terminal's ^\ reaches them too)
            self.shutdown.start()
            requests = self.dumper.snapshot()
            failed = ServerError("The server failed: the ingress received SIGQUIT", 500)
            self.ingress.fail_all(failed)
            self.workers.fail(failed)
            running = [actor for actor in actors if actor.popen.poll() is None]
            await gather_evidence(self.args.crash_dump_folder, running, running)
            await self.dumper.write(DumpReason.SIGQUIT, message="the ingress received SIGQUIT", requests=requests,
                                    actor="ingress", wait_s=0)
            raise ServerQuit("SIGQUIT received")

    async def _fail_on_stall(self) -> None:
        """An actor made no progress for --watchdog-timeout: /health turns 503 and every open
        request is answered with a 500 naming it; its stacks (and the scheduler's view) are asked
        for, the crash dump written, the actor killed (it cannot stop by itself); then ActorStalled
        (an ActorDied) is raised."""
        if self.watchdog is None:
            return
        stalled = await self.watchdog.wait_for_stall()
        if self.shutdown.started:  # a failure or a stop is already under way: it is that one's to report
            return
        self.shutdown.start()
        self.ingress.set_state(ServerState.STOPPING)
        self.log.error("watchdog: an actor made no progress", target=actor_title(stalled.actor),
                       stalled_s=stalled.report["stalled_s"], busy=stalled.report["busy"],
                       unread_bytes=stalled.report["unread_bytes"])
        requests = self.dumper.snapshot()
        failed = ServerError(f"The server failed: {stalled.summary}", 500)
        self.ingress.fail_all(failed)
        self.workers.fail(failed)
        actors = self.supervisor.actors
        for actor in actors:
            actor.stopping = True  # their exits are expected from here on
        running = [actor for actor in actors if actor.popen.poll() is None]
        await gather_evidence(self.args.crash_dump_folder, running, running)
        await self.dumper.write(DumpReason.WATCHDOG, died=stalled, requests=requests, wait_s=0)
        for actor in running:
            if actor.name == stalled.actor:
                actor.popen.kill()  # SIGKILL ends a stopped or hung process too
        raise stalled

    async def _fail_on_death(self) -> None:
        """An actor died: answer every open request with a 500 naming the root cause, write the
        crash dump (with the requests it cut short), then raise ActorDied."""
        died = await self.supervisor.wait_for_death()
        self.shutdown.start()
        reason = died.summary
        requests = self.dumper.snapshot()
        failed = ServerError(f"The server failed: {reason}", 500)
        self.ingress.fail_all(failed)
        self.workers.fail(failed)
        await self.dumper.write(DumpReason.ACTOR_DIED, died=died, requests=requests)
        raise died

    def _exit_code(self, group: BaseExceptionGroup) -> int:
        """What ended the server, as an exit code; anything unforeseen is raised again."""
        failure = find_exception(group, ActorDied) or find_exception(group, ActorStartError)
        if failure is not None:
            self.log.error("server failed", error=str(failure))
            return EXIT_FAILED
        if find_exception(group, ServerQuit) is not None:
            return EXIT_FAILED
        unbound = find_exception(group, BindError)
        if unbound is not None:
            self.log.error("cannot serve HTTP", host=self.args.host, port=self.args.port, error=str(unbound))
            return EXIT_FAILED
        if find_exception(group, ServerStopping) is not None:
            return EXIT_OK
        raise group


@contextmanager
def _actors_on_channels(
    args: ServerArgs, model: ModelCard, model_path: str, vocab_size: int, lanes: int, front: FrontLaunch,
) -> Iterator[tuple[Endpoints, list[Endpoints], list[ActorProcess], tuple[HeartbeatBoard, ChannelGauges]]]:
    """The channel graph of ``lanes`` lanes, lane 0's ingress ends of it and the supervisor's ends
    of each worker lane's, the actors spawned on it, and what the watchdog reads (the actors'
    heartbeats, the channels' indices).

    On leaving: the actors are closed (killed if still running: the supervisor has stopped
    them gracefully before), then the ingress's ends. Our copies of the other descriptors go
    as soon as the children hold theirs (the watchdog's mappings keep what it reads).
    """
    with ExitStack() as owned:
        board = owned.enter_context(HeartbeatBoard(lane_actor_names(lanes)))
        with ChannelGraph.create(lanes=lanes) as graph:
            endpoints = owned.enter_context(Endpoints("ingress", graph.specs_for("ingress")))
            workers = [owned.enter_context(Endpoints("supervisor", graph.specs_for("supervisor", lane)))
                       for lane in range(1, lanes)]
            gauges = owned.enter_context(ChannelGauges(graph))
            launches = _launches(args, model_path, model.context_length, vocab_size, graph, board, front)
            actors = owned.enter_context(spawned_actors(launches))
        yield endpoints, workers, actors, (board, gauges)


def serve(argv: list[str]) -> int:
    """Run the server until a signal or a failure; return the process exit code."""
    args = parse_server_args(argv)
    configure_logging("ingress", args.log_level, json=args.log_json)
    log = get_logger()
    prepare_dump_folder(args.crash_dump_folder)
    _forget_keys_in_environment(argv, log)
    if args.model_path is None:
        from app.engine.make_checkpoint import default_model_dir

        model_path = str(default_model_dir())
        log.warning("no --model-path: serving the embedded tiny model (random weights, gibberish output)", path=model_path)
    else:
        model_path = args.model_path
    model_config = ModelConfig.from_pretrained(model_path)
    context_len = args.context_length or model_config.max_context_len
    model = ModelCard(
        name=args.served_model_name or Path(model_path).name,
        path=model_path,
        context_length=context_len,
        vocab_size=model_config.vocab_size,
        architecture=model_config.architecture,
    )
    defaults = sampling_defaults(model_path)  # before spawning: a bad file is a clear error at start
    tokenizer = Tokenizer.from_dir(model_path) if (Path(model_path) / "tokenizer.json").is_file() else None
    lanes = args.ingress_workers or default_ingress_workers(len(os.sched_getaffinity(0)))
    try:
        listening = bind_http(args.host, args.port)  # before spawning: the worker fronts share it
    except BindError as exc:
        log.error("cannot serve HTTP", host=args.host, port=args.port, error=str(exc))
        return EXIT_FAILED
    keys = {env: key.reveal() for env, key in ((API_KEY_ENV, args.api_key), (ADMIN_API_KEY_ENV, args.admin_api_key))
            if key is not None}
    front = FrontLaunch(list(argv), keys, model, tuple(sock.fileno() for sock in listening))
    with (
        ExitStack() as sockets,
        native_traces(args.crash_dump_folder, "ingress"),  # faulthandler, before the actors are spawned
        _actors_on_channels(args, model, model_path, model_config.vocab_size, lanes, front)
        as (endpoints, workers, actors, progress),
        process_tracing(args.observability, "ingress") as tracing,
    ):
        for sock in listening:
            sockets.callback(sock.close)
        server = Server(args, actors, endpoints, model, defaults, tokenizer, tracing, progress, workers, listening)
        try:
            return trio.run(server.run)
        finally:
            remove_empty_traces(args.crash_dump_folder, [(actor.name, actor.pid) for actor in actors])


def main(argv: list[str] | None = None) -> int:
    try:
        return serve(sys.argv[2:] if argv is None else argv)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
