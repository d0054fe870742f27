"""The scheduler's own crash dump: its state at the moment it failed, written by itself.

Only the scheduler knows its running batch, its waiting queue, the request whose prompt is
part-way in, its KV pool and its recent requests, and it knows them only while it runs. So
when its run ends on an exception (a step raised) or because a peer died, and
``--crash-dump-folder`` is set, it writes ``actor_dump_<actor>_<pid>_<time>.json`` before the
process exits (the supervisor waits for that exit and merges the file into the server's dump).
The exception also goes to the supervisor as a failure report (failure_report.py) first, so
that the root cause is known even when the folder is not set or the write fails.

It also writes its view while it runs, when the supervisor asks (``VIEW_SIGNAL``, SIGUSR1: the
watchdog or a SIGQUIT dump, live_evidence.py), and before it stops on a SIGQUIT of its own.

Every section is read on its own, so a dump written from a half-done step (a structure in the
middle of an update) still holds the rest, with an ``error`` in the section that failed. The
dump written on the way out of a failed run sees a stopped scheduler: the step runs in the loop's
thread, so none is running once the exception leaves the loop.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from app.actors.failure_report import (
    QuitSignal,
    exception_report,
    failure_kind,
    report_sigquit,
    root_exception,
    send_report,
)
from app.observability.crash_dump import (
    DumpReason,
    actor_dump_name,
    dump_header,
    mask_secrets,
    versions,
    write_crash_dump,
)
from app.observability.live_evidence import VIEW_SIGNAL
from app.observability.logs import get_logger
from app.engine.scheduling.events import add_observer
from app.observability.request_history import RequestHistory, request_record
from app.observability.settings import ObservabilitySettings


def hold_view_signal() -> None:
    """Block VIEW_SIGNAL in this thread and so in every thread it starts from now on: the view
    thread (``answer_signals``) takes it with sigwait, whichever thread the kernel would have
    picked. Call it first thing in the scheduler's process, before any other thread starts."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {VIEW_SIGNAL})


def _section(read: Callable[[], Any]) -> Any:
    """``read()``, or what went wrong reading it (a dump is written even from a broken state)."""
    try:
        return read()
    except Exception as exc:  # noqa: BLE001 - one unreadable section must not cost the others
        return {"error": f"{type(exc).__name__}: {exc}"}


def _kv_pool(scheduler: Any) -> dict[str, Any]:
    usage = scheduler.memory.usage(scheduler.requests.values())
    cache = scheduler.memory.cache
    return {**usage._asdict(), "radix_tree_tokens": cache.total_size(), "radix_cache_disabled": cache.disabled}


def _chunked(scheduler: Any) -> dict[str, Any] | None:
    req = scheduler.prefill.partial
    return None if req is None else {"rid": req.rid, "prompt_tokens": len(req.prompt_ids), "computed_tokens": req.kv_len}


def scheduler_state(loop: Any, history: RequestHistory, level: int) -> dict[str, Any]:
    """The scheduler's state (``loop``: the actor's SchedulerLoop) as a dump shows it."""
    scheduler = loop.scheduler
    built = loop.built
    return {
        "running_batch": _section(lambda: [req.rid for req in scheduler.running]),
        "waiting_queue": _section(lambda: [req.rid for req in scheduler.waiting]),
        "chunked_request": _section(lambda: _chunked(scheduler)),
        "step_in_flight": _section(lambda: scheduler.pipeline.in_flight is not None),
        "inbox_messages": len(loop.inbox),
        "kv_pool": _section(lambda: _kv_pool(scheduler)),
        "counters": _section(lambda: {"forward_steps": scheduler.forward_steps, "retractions": scheduler.retractions,
                                      "preemptions": scheduler.retraction.preemptions}),
        "limits": _section(lambda: {
            "max_total_tokens": built.max_total_tokens, "max_running_requests": built.max_running_requests,
            "max_queued_requests": scheduler.waiting.max_queued, "context_length": built.context_len,
            "chunked_prefill_size": built.chunked_prefill_size, "schedule_policy": scheduler.limits.schedule_policy,
            "priority_scheduling": scheduler.limits.priority_scheduling}),
        "requests": _section(lambda: [
            request_record(req, level, first_token_time=history.first_tokens.get(req.rid))
            for req in list(scheduler.requests.values())]),
    }


def device_versions(built: Any) -> dict[str, Any]:
    """The device the engine runs on, for a dump's ``versions``."""
    import torch

    device = str(built.device)
    found: dict[str, Any] = {"device": device, "dtype": str(built.dtype).removeprefix("torch.")}
    if device.startswith("cuda"):
        found["device_name"] = torch.cuda.get_device_name(built.device)
    return found


class SchedulerCrashView:
    """The scheduler actor's crash-dump writer and the request history it reads from.

    ``watch()`` wraps the actor's run: the history observes the scheduler's events, and an
    exception (or a dead peer) ending the run writes the dump on its way out.
    """

    def __init__(self, loop: Any, config: dict[str, Any], actor: str) -> None:
        self.loop = loop
        self.actor = actor
        self.folder: str | None = config.get("crash_dump_folder")
        self.level = ObservabilitySettings.from_config(config.get("observability")).log_requests_level
        self.engine = config.get("engine") or {}
        self.history = RequestHistory()
        add_observer(loop.scheduler, self.history)

    @asynccontextmanager
    async def watch(self) -> AsyncIterator[None]:
        """Write the dump when the block ends on an exception or a dead peer (not on a
        cancellation: a requested stop)."""
        try:
            yield
        except BaseException as exc:
            if isinstance(root_exception(exc), QuitSignal):
                raise  # answer_signals wrote the dump and the report
            kind = failure_kind(exc)
            if kind == "exception":
                send_report(exception_report(exc))  # the root cause reaches the supervisor first
                self.write(DumpReason.SCHEDULER_EXCEPTION, exc)
            elif kind == "peer_gone":
                self.write(DumpReason.PEER_DIED, exc)
            raise

    async def answer_signals(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """While the scheduler runs: VIEW_SIGNAL (the supervisor's watchdog or SIGQUIT dump asks)
        writes the view and goes on; SIGQUIT writes it and stops the scheduler as failed. This
        receiver, opened inside the one every actor has (child.py), takes SIGQUIT over from it.

        The view is written by a thread of its own that waits for VIEW_SIGNAL (which
        :func:`hold_view_signal` blocked in every thread), not by the trio loop: the forward step
        runs in the loop's thread, and a hung step (or one stuck in a device call) must still give
        its view. Each section is read on its own (``_section``), so a structure caught in the
        middle of an update costs that section only."""
        threading.Thread(target=self._answer_view_requests, name="scheduler-view", daemon=True).start()
        with trio.open_signal_receiver(signal.SIGQUIT) as signals:
            task_status.started()
            async for _ in signals:
                get_logger().error("SIGQUIT received: writing the scheduler's view and stopping as failed")
                self.write(DumpReason.SIGQUIT, message="SIGQUIT received by the scheduler")
                raise report_sigquit()

    def _answer_view_requests(self) -> None:
        while True:
            signal.sigwait({VIEW_SIGNAL})
            self.write(DumpReason.REQUESTED, message="the supervisor asked for the scheduler's view")

    def dump(self, reason: DumpReason, exc: BaseException | None = None, message: str | None = None) -> dict[str, Any]:
        """The dump's content (the watchdog or a signal handler may call this too)."""
        root = None if exc is None else root_exception(exc)
        own = reason not in (DumpReason.PEER_DIED, DumpReason.REQUESTED)
        if message is None:
            message = f"{type(root).__name__}: {root}" if root is not None else reason.value
        dump = dump_header(writer=self.actor, reason=reason, message=message[:2000], actor=self.actor if own else None)
        now = time.time()
        dump.update({
            "failure": None if exc is None or not own else {"actor": self.actor, "exception": exception_report(exc)},
            "versions": _section(lambda: versions(device_versions(self.loop.built))),
            "engine_args": mask_secrets(self.engine),
            "scheduler": _section(lambda: scheduler_state(self.loop, self.history, self.level)),
            "recent_requests": _section(lambda: self.history.recent(now, self.level)),
            "log_requests_level": self.level,
        })
        return dump

    def write(self, reason: DumpReason, exc: BaseException | None = None, message: str | None = None) -> Path | None:
        """Write the dump into the folder, if there is one; never raises (the process is failing)."""
        if self.folder is None:
            return None
        log = get_logger()
        try:
            started = time.perf_counter()
            path = write_crash_dump(self.folder, self.dump(reason, exc, message), actor_dump_name(self.actor))
        except Exception as error:  # noqa: BLE001 - a failing write must not hide the failure itself
            log.error("could not write the scheduler's crash dump", error=repr(error))
            return None
        log.error("scheduler crash dump written", path=str(path), reason=reason.value,
                  write_s=round(time.perf_counter() - started, 3))
        sys.stderr.flush()
        return path
