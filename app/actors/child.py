"""What every actor process does around its own work: the child half of supervision.

An actor module's ``main()`` calls :func:`run_actor` with its name and its trio entry
point. This function, in order: reads the JSON configuration from stdin, ties the process
to its parent (PDEATHSIG), ignores SIGINT (Ctrl-C reaches the whole process group; the
supervisor decides what happens), names the thread for ``top``, enables faulthandler (into
the crash-dump folder when there is one: native_traces.py), sets up logging, and runs the
actor under trio. SIGTERM cancels the actor cleanly (exit 0); SIGQUIT stops it as failed, with
its stacks in its trace file (exit 1; docs/faults.md); an exception is logged and exits
non-zero, which the supervisor sees. Either way the actor first tells the supervisor why, in a
failure report on stderr (failure_report.py), so that the root cause of a failure is known.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from app.actors.failure_report import (
    QuitSignal,
    exception_report,
    failure_kind,
    report_sigquit,
    root_exception,
    send_report,
)
from app.actors.lifeline import die_with_parent
from app.actors.process import EXIT_PEER_GONE
from app.errors import find_exception
from app.observability.logs import actor_title, configure_logging, get_logger
from app.observability.native_traces import close_native_traces, enable_native_traces

_PR_SET_NAME = 15

ReadyCallback = Callable[[dict[str, Any]], None]
ActorMain = Callable[[dict[str, Any], ReadyCallback], Awaitable[None]]


def _own_rss_mb() -> float | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _report_ready(info: dict[str, Any]) -> None:
    """One JSON line on stdout tells the supervisor we are ready; stdout is then closed.

    It adds this actor's own start-up time (from the supervisor's spawn, on the system-wide
    monotonic clock) and resident memory, so that each actor's cost is visible in the logs.
    """
    spawned_at = float(os.environ.get("APP_SPAWNED_AT", "0") or 0)
    measured = {"startup_s": round(time.monotonic() - spawned_at, 3) if spawned_at else None, "rss_mb": _own_rss_mb()}
    sys.stdout.buffer.write(msgspec.json.encode({"ready": {**info, **measured}}) + b"\n")
    sys.stdout.flush()
    sys.stdout.close()


def _name_thread(title: str) -> None:
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, title.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


async def _cancel_on_sigterm(scope: trio.CancelScope, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            get_logger().info("SIGTERM received: stopping")
            send_report({"kind": "signal", "signal": "SIGTERM"})  # the supervisor's, or someone else's
            scope.cancel()
            return


async def _fail_on_sigquit(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """SIGQUIT: stop as failed, with the stacks and a report (an actor may take the signal over
    while it runs, by opening its own receiver: the scheduler writes its view first)."""
    with trio.open_signal_receiver(signal.SIGQUIT) as signals:
        task_status.started()
        async for _ in signals:
            get_logger().error("SIGQUIT received: stopping as failed")
            raise report_sigquit()


async def _run_until_sigterm(main: ActorMain, config: dict[str, Any]) -> None:
    """Run the actor until it returns; SIGTERM cancels it, a clean stop (exit 0); SIGQUIT
    stops it as failed (exit 1)."""
    async with trio.open_nursery() as nursery:
        await nursery.start(_cancel_on_sigterm, nursery.cancel_scope)  # before main can report ready
        await nursery.start(_fail_on_sigquit)
        await main(config, _report_ready)
        nursery.cancel_scope.cancel()


def _system_exit_code(exc: BaseException) -> int | None:
    """The exit code when ``exc`` is a SystemExit (possibly inside a nursery's group)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else 1
    return None


def run_actor(name: str, main: ActorMain) -> None:
    """Run one actor process to completion; never returns normally (exits the process)."""
    config = msgspec.json.decode(sys.stdin.buffer.read())
    parent = int(os.environ.get("APP_PARENT_PID", "0"))
    if parent:
        die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _name_thread(actor_title(name))
    traces = enable_native_traces(config.get("crash_dump_folder"), name)
    configure_logging(name, config.get("log_level", "info"), json=config.get("log_json", False))
    log = get_logger()
    try:
        trio.run(_run_until_sigterm, main, config)
    except BaseException as exc:  # noqa: BLE001 - anything that ends an actor is reported
        close_native_traces(traces)  # no native fault happened: a Python exception got here
        code = _system_exit_code(exc)
        sys.stderr.flush()
        if code is not None:
            os._exit(code)
        if failure_kind(exc) == "peer_gone":
            peer_gone = find_exception(exc, trio.BrokenResourceError)
            log.error("a peer actor died: stopping", error=str(peer_gone))
            send_report({"kind": "peer_gone", "message": str(peer_gone)})
            os._exit(EXIT_PEER_GONE)
        if isinstance(root_exception(exc), QuitSignal):  # said and reported already
            os._exit(1)
        log.exception("actor failed", error=repr(exc))
        send_report(exception_report(exc))
        os._exit(1)
    log.debug("actor stopped")
    close_native_traces(traces)
    sys.stderr.flush()
    os._exit(0)
