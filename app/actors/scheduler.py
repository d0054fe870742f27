"""The scheduler actor: owns the engine and the device, runs the batching loop.

Receive tasks fill an inbox (requests, aborts and control from each lane's tokenizer; stop-string
hits from each lane's detokenizer: graph.py) between steps; the step itself runs in the loop
(what arrives meanwhile waits in its ring, a step long at most). The loop applies the inbox
between steps, runs a step when there is work, sends each request's outputs down its own lane,
and sleeps on an event when there is none (no spinning when idle), waking at the nearest
request deadline (``--waiting-timeout``, ``--request-timeout``) to expire it even when no step
runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from functools import partial
from typing import Any

import trio

from app.actors.child import ReadyCallback, run_actor
from app.actors.endpoints import Endpoints
from app.actors.faults import FaultPlan, around
from app.actors.heartbeat import Heartbeat
from app.actors.step_recovery import StepRecovery
from app.ipc.trace import RequestTrace
from app.ipc.batching import batches_under, token_output_size
from app.ipc.messages import (
    AbortRequest,
    ControlKind,
    ControlReply,
    ControlRequest,
    StepOutput,
    StopStringHit,
    TokenizedRequest,
    unpack_tokens,
)
from app.observability.logs import get_logger
from app.observability.scheduler_dump import SchedulerCrashView, hold_view_signal
from app.observability.tracing import actor_tracing
from app.observability.settings import ObservabilitySettings


class SchedulerLoop:
    """The actor's state around the engine's Scheduler; see the module docstring."""

    def __init__(self, built: Any, endpoints: Endpoints | Sequence[Endpoints],
                 observability: ObservabilitySettings | None = None, observers: Sequence[Any] = ()) -> None:
        """``endpoints``: each lane's channels (graph.py; one lane without ingress workers);
        ``observers``: SchedulerEvents told of every scheduling moment, beside the scheduler's
        own log lines (traces, metrics)."""
        from app.engine.scheduling.events import EventFanOut  # the engine (torch) loads once the actor runs
        from app.observability.scheduler_log import scheduler_log_observers

        self.built = built
        self.scheduler = built.scheduler
        logs = scheduler_log_observers(self.scheduler, observability or ObservabilitySettings())
        self.scheduler.events = EventFanOut([*logs, *observers])
        lanes = [endpoints] if not isinstance(endpoints, Sequence) else list(endpoints)
        self.lanes = lanes
        self.to_detokenizers = [lane.senders["to_detokenizer"] for lane in lanes]
        self.to_detokenizer = self.to_detokenizers[0]  # lane 0's: metrics snapshots go this way
        self.lane_of: dict[str, int] = {}  # rid -> its lane, while it runs (several lanes only)
        self.inbox: list[tuple[int, Any]] = []  # (lane, message)
        self.wake = trio.Event()
        self.upstreams_open = len(lanes)
        self.log = get_logger()
        self.trace = RequestTrace.from_env("scheduler")
        self.metrics: Any = None  # --enable-metrics: a SchedulerMetrics (scheduler_main sets it)
        # A step that runs out of device memory ends its requests, not the server (step_recovery.py).
        self.step = StepRecovery(self.scheduler, around(FaultPlan.from_env("scheduler"), "step", self.scheduler.step))
        self.heartbeat: Heartbeat | None = None  # the watchdog's sign of progress (scheduler_main sets it)

    @property
    def upstream_open(self) -> bool:
        """Some lane's tokenizer may still send requests."""
        return self.upstreams_open > 0

    async def pump(self, channel: Any, *, upstream: bool, lane: int = 0) -> None:
        """Move messages from ``channel`` (of ``lane``) to the inbox as they arrive."""
        async for message in channel:
            if self.trace.enabled and isinstance(message, TokenizedRequest):
                self.trace.mark("scheduler.recv", message.rid)
            self.inbox.append((lane, message))
            self.wake.set()
        if upstream:
            self.upstreams_open -= 1
            self.wake.set()

    async def run(self) -> None:
        while self.upstream_open or self.scheduler.has_work():
            if not self.inbox and not self.scheduler.has_work():
                self.wake = trio.Event()
                if self.metrics is not None:  # the gauges as they are at rest (0), before sleeping
                    await self.metrics.went_idle(self.to_detokenizer.send)
                self.beat(busy=False)
                await self.sleep()
            messages, self.inbox = self.inbox, []
            replies = [(lane, reply) for lane, message in messages if (reply := self.apply(message, lane)) is not None]
            if self.scheduler.has_work():
                self.beat(busy=True)  # a step that never returns leaves the beats still and busy
                # The step runs right here, blocking the loop: handing it to a worker thread and
                # back costs ~55 µs a step (2-core CPU), 4-7 % of a one-token step on the CPU or
                # the H200. Messages that arrive meanwhile wait in their rings; the checkpoint
                # after the outputs lets the receive tasks move them to the inbox.
                self.trace.mark("scheduler.step", "", len(messages))
                outputs = self.step()
                self.trace.mark("scheduler.stepped", "", len(outputs))
                if len(self.lanes) == 1:
                    await self.send_outputs(self.to_detokenizer, outputs)
                else:
                    for lane, lane_outputs in enumerate(self.by_lane(outputs)):
                        if lane_outputs:
                            await self.send_outputs(self.to_detokenizers[lane], lane_outputs)
            for lane, reply in replies:  # after the outputs of the requests that came before them
                await self.to_detokenizers[lane].send(reply)
            if self.metrics is not None:
                await self.metrics.publish_if_due(self.to_detokenizer.send)
            await trio.lowlevel.checkpoint()  # the receive tasks' turn: what arrived during the step

    @staticmethod
    async def send_outputs(channel: Any, outputs: Sequence[Any]) -> None:
        """One step's outputs as few StepOutputs as fit the channel (one, nearly always)."""
        limit = channel.max_message_bytes // 2  # room for the estimate's slack
        for part in batches_under(outputs, token_output_size, limit):
            await channel.send(StepOutput(tuple(part)))

    def by_lane(self, outputs: Sequence[Any]) -> list[list[Any]]:
        """A step's outputs split by the lane each request came from; a finished request's
        lane is forgotten."""
        lanes: list[list[Any]] = [[] for _ in self.lanes]
        lane_of = self.lane_of
        for output in outputs:
            lanes[lane_of.get(output.rid, 0)].append(output)
            if output.finish is not None:
                lane_of.pop(output.rid, None)
        return lanes

    def beat(self, *, busy: bool) -> None:
        """A turn of the loop, for the watchdog (app/actors/heartbeat.py)."""
        if self.heartbeat is not None:
            self.heartbeat.beat(busy)

    async def sleep(self) -> None:
        """Wait for a message, or for the nearest request deadline, then expire what is due (its
        503 goes out with the next step's outputs)."""
        nearest = self.scheduler.deadlines.nearest()
        if nearest is None:
            await self.wake.wait()
            return
        with trio.move_on_after(max(0.0, nearest - time.time())):
            await self.wake.wait()
        self.scheduler.expire_timeouts()

    def apply(self, message: Any, lane: int = 0) -> ControlReply | None:
        scheduler = self.scheduler
        if isinstance(message, TokenizedRequest):
            if len(self.lanes) > 1:
                self.lane_of[message.rid] = lane
            self.add(message)
        elif isinstance(message, AbortRequest):
            scheduler.abort(message.rid, message.message, message.status_code)
        elif isinstance(message, StopStringHit):
            scheduler.finish_by_stop_string(message.rid, message.stop)
        elif isinstance(message, ControlRequest):
            return self.control(message)
        return None

    def add(self, message: TokenizedRequest) -> None:
        """Queue one request; one that cannot run is answered with an error, never raised: a
        malformed request must not take the scheduler (and the server) down with it."""
        from app.engine.request import Request
        from app.engine.sampling import request_seed
        from app.engine.scheduling import QueueFullError

        self.trace.mark("scheduler.add", message.rid)
        try:
            message.sampling.validate(self.built.model_config.vocab_size)
            req = Request(
                message.rid,
                unpack_tokens(message.input_ids),
                message.sampling,
                request_seed(message.sampling),
                stream=message.stream,
                priority=message.priority,
                arrival_time=message.arrival_time,
                traceparent=message.traceparent,
            )
            self.scheduler.add_request(req)
        except QueueFullError as exc:  # overload: the client may retry (the HTTP layer adds Retry-After)
            self.refuse(message.rid, str(exc), 503)
        except ValueError as exc:  # AdmissionError, duplicate rid, a range: the client's mistake
            self.refuse(message.rid, str(exc), 400)
        except Exception:
            self.log.exception("request refused: it could not be queued", rid=message.rid)
            self.refuse(message.rid, "Internal error while queueing the request.", 500)

    def refuse(self, rid: str, message: str, status_code: int) -> None:
        """Answer ``rid`` with an error finish, sent with the next step's outputs."""
        self.scheduler.refuse(rid, message, status_code)

    def control(self, message: ControlRequest) -> ControlReply:
        kind = message.kind
        if kind is ControlKind.FLUSH_CACHE:
            flushed = self.scheduler.memory.flush_cache()
            error = None if flushed else "Cache not flushed: requests are still running."
            return ControlReply(message.id, kind, flushed, error=error)
        if kind is ControlKind.SERVER_INFO:
            return ControlReply(message.id, kind, True, json.dumps(self.info()).encode())
        if kind is ControlKind.DUMP_STATE:
            return ControlReply(message.id, kind, True, json.dumps(self.state_dump()).encode())
        if kind is ControlKind.SHUTDOWN:
            self.scheduler.abort(None, "the server is shutting down", 503)
        return ControlReply(message.id, kind, True)

    def info(self) -> dict[str, Any]:
        stats = self.scheduler.stats()
        built = self.built
        return {
            "running_requests": stats.running,
            "prefilling_requests": stats.prefilling,
            "queued_requests": stats.waiting,
            "kv_pool": stats.usage._asdict(),
            "token_usage": round(stats.usage.used / stats.usage.total, 4),
            "forward_steps": self.scheduler.forward_steps,
            "retractions": self.scheduler.retractions,
            "preemptions": self.scheduler.retraction.preemptions,  # running requests sent back for a more important one
            "kv_swap": None if self.scheduler.swap is None else self.scheduler.swap.figures(),  # --enable-kv-swap
            # Where the step time goes: device_busy_share = device_s / active_s (see step_results.py).
            "step_timing": self.scheduler.timing.as_dict(),
            "max_total_tokens": built.max_total_tokens,
            "max_running_requests": built.max_running_requests,
            "max_queued_requests": self.scheduler.waiting.max_queued,  # None: unbounded
            "schedule_policy": self.scheduler.limits.schedule_policy,
            "priority_scheduling": self.scheduler.limits.priority_scheduling,
            "waiting_timeout_s": self.scheduler.deadlines.waiting_timeout,  # None: only a request's own
            "request_timeout_s": self.scheduler.deadlines.request_timeout,
            "context_length": built.context_len,
            "chunked_prefill_size": built.chunked_prefill_size,
            "device": str(built.device),
            "dtype": str(built.dtype).removeprefix("torch."),
            "cuda_graph_batch_sizes": list(built.cuda_graph_batch_sizes),
            "prefill_graph_tokens": list(built.prefill_graph_tokens),
            "decode_tiling": built.decode_tiling,
            "kernel_plan": built.plan.as_dict(),  # what runs: the kernel options resolved for this device
            "prefills_ahead": self.scheduler.prefills_ahead,
        }

    def state_dump(self) -> dict[str, Any]:
        now = time.time()
        return {
            "requests": [
                {
                    "rid": r.rid,
                    "status": r.status.value,
                    "prompt_tokens": len(r.prompt_ids),
                    "output_tokens": len(r.output_ids),
                    "age_s": round(now - r.arrival_time, 3) if r.arrival_time else None,
                }
                for r in self.scheduler.live_requests()
            ],
            **self.info(),
        }


async def scheduler_main(config: dict[str, Any], ready: ReadyCallback) -> None:
    hold_view_signal()  # before torch and the loader start threads (scheduler_dump.py)
    import torch  # after run_actor set the environment: the thread count is read at import

    from app.engine.builder import build_scheduler
    from app.engine.config import EngineConfig
    from app.text.tokenizer import Tokenizer

    threads = int(config.get("threads") or os.cpu_count() or 1)
    torch.set_num_threads(threads)
    engine_config = EngineConfig(**config["engine"])
    model_dir = engine_config.model_path
    tokenizer = Tokenizer.from_dir(model_dir) if os.path.isfile(os.path.join(model_dir, "tokenizer.json")) else None
    started = time.monotonic()
    built = await trio.to_thread.run_sync(build_scheduler, engine_config, tokenizer)  # loading blocks for seconds
    log = get_logger()
    log.info(
        "engine ready",
        device=str(built.device),
        dtype=str(built.dtype),
        max_total_tokens=built.max_total_tokens,
        context_length=built.context_len,
        load_s=round(time.monotonic() - started, 2),
        torch_threads=threads,
        cuda_graphs=len(built.cuda_graph_batch_sizes),
        cuda_graph_capture_s=built.cuda_graph_capture_s,
        kernel_plan=built.plan.as_dict(),
    )
    with ExitStack() as opened, actor_tracing(config, "scheduler") as tracing:
        lanes = [opened.enter_context(Endpoints("scheduler", specs)) for specs in config["lanes"]]
        observers = []
        if tracing is not None:  # --enable-trace: the queue, prefill and decode spans of traced requests
            from app.observability.scheduler_spans import SchedulerSpans

            observers.append(SchedulerSpans(tracing))
        settings = ObservabilitySettings.from_config(config.get("observability"))
        loop = SchedulerLoop(built, lanes, settings, observers)
        if settings.enable_metrics:
            from app.observability.scheduler_metrics import scheduler_metrics  # imports torch: not before here

            loop.metrics = scheduler_metrics(loop.scheduler)
            loop.step.on_failure.append(loop.metrics.step_failed)
        loop.heartbeat = Heartbeat.from_config(config)
        crash_view = SchedulerCrashView(loop, config, sys.argv[-1].removeprefix("app::"))  # its crash dump
        async with crash_view.watch(), trio.open_nursery() as nursery:
            await nursery.start(crash_view.answer_signals)  # the view on request, and on SIGQUIT
            for lane, channels in enumerate(lanes):
                nursery.start_soon(partial(loop.pump, channels.receivers["tokenizer_to_scheduler"], upstream=True,
                                           lane=lane))
                nursery.start_soon(partial(loop.pump, channels.receivers["detokenizer_to_scheduler"], upstream=False,
                                           lane=lane))
            ready({"max_total_tokens": built.max_total_tokens, "context_length": built.context_len,
                   "device": str(built.device)})
            await loop.run()
            nursery.cancel_scope.cancel()
    log.info("upstream closed and no work left: stopping")


def main() -> None:
    run_actor(sys.argv[-1].removeprefix("app::"), scheduler_main)


if __name__ == "__main__":
    main()
