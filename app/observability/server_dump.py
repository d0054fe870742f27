"""The server-level crash dump, written by the supervisor (the ingress process).

The supervisor outlives every actor, so it writes the dump whatever failed: which actor died
first and how (its exception and traceback from its failure report, or its signal, exit code,
native traceback and last stderr lines), the state of every other actor, the settings with
secrets masked, the versions, every request in flight as the ingress knows it (with its input,
as ``--log-requests-level`` allows), and, merged in, what the scheduler wrote of itself when it
could (its state, its recent requests: scheduler_dump.py). It waits a moment for the actors
still exiting, since a scheduler that follows a dead peer writes its view on its way out.

:meth:`ServerDumper.write` is the one entry point: the supervisor calls it when an actor died
(``DumpReason.ACTOR_DIED``); a watchdog or a SIGQUIT handler calls it with its own reason.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import msgspec
import trio

from app.actors.process import ActorDied, ActorProcess
from app.ipc.messages import unpack_tokens
from app.observability.crash_dump import (
    DumpReason,
    dump_header,
    find_actor_dumps,
    mask_secrets,
    read_crash_dump,
    server_dump_name,
    versions,
    write_crash_dump,
)
from app.observability.logs import get_logger
from app.observability.native_traces import native_trace_path, read_native_trace, remove_if_empty
from app.observability.request_history import cut_input

ACTOR_EXIT_WAIT_S = 0.8  # how long the dump waits for a scheduler still exiting (writing its own view)


def ingress_records(pending: dict[str, Any], level: int) -> list[dict[str, Any]]:
    """Every request the ingress holds (``Ingress.pending``), as a dump shows it (inputs as
    ``level`` allows: request_history.py). Cheap: called before the clients are answered."""
    records = []
    for rid, entry in pending.items():
        request = entry.request
        record: dict[str, Any] = {
            "rid": rid,
            "state": "answered" if entry.finished else "in_flight",
            "priority": request.priority,
            "stream": request.stream,
            "arrival_time": request.arrival_time or entry.started,
            "first_output_time": getattr(entry, "first_answer", None),
        }
        if level >= 1:
            record["sampling"] = msgspec.to_builtins(request.sampling)
        if level >= 2:
            if request.text is not None:
                record["text"], record["input_cut"] = cut_input(request.text, level)
            elif request.input_ids is not None:
                ids, record["input_cut"] = cut_input(unpack_tokens(request.input_ids), level)
                record["input_ids"] = list(ids)
            elif request.messages is not None:
                cut = [cut_input(m.content, level) for m in request.messages]
                record["messages"] = [{"role": m.role, "content": text} for m, (text, _) in zip(request.messages, cut)]
                record["input_cut"] = any(was_cut for _, was_cut in cut)
        records.append(record)
    return records


def _merge_scheduler_view(records: list[dict[str, Any]], scheduler: Any) -> list[dict[str, Any]]:
    """The ingress's records, each with what the scheduler knew of it (``scheduler``: its state
    section) when it wrote its view."""
    known = {}
    if isinstance(scheduler, dict) and isinstance(scheduler.get("requests"), list):
        known = {r["rid"]: r for r in scheduler["requests"] if isinstance(r, dict) and "rid" in r}
    merged = []
    for record in records:
        view = known.get(record["rid"])
        if view is not None:
            record = {**record, "scheduler": {k: v for k, v in view.items() if k not in ("rid", "input_ids", "sampling")}}
        merged.append(record)
    return merged


def _actor_state(actor: ActorProcess, root: ActorDied | None) -> str:
    """``failed`` (the root cause), ``running``, or ``exited`` (it followed, or was stopped)."""
    if root is not None and actor.name == root.actor:
        return "failed"
    return "running" if actor.popen.poll() is None else "exited"


class ServerDumper:
    """Writes the server-level dump; built by the Server with what it owns."""

    def __init__(self, folder: str | None, server_args: dict[str, Any], actors: list[ActorProcess],
                 pending: dict[str, Any], level: int) -> None:
        self.folder = folder
        self.server_args = server_args  # ServerArgs.to_dict(): keys already "<set>"; masked again here
        self.actors = actors
        self.pending = pending  # Ingress.pending (read, never changed)
        self.level = level
        self.log = get_logger()

    def snapshot(self) -> list[dict[str, Any]]:
        """The requests in flight now: take it before the clients are answered (and released)."""
        return ingress_records(self.pending, self.level)

    async def write(self, reason: DumpReason, *, died: ActorDied | None = None, message: str | None = None,
                    requests: list[dict[str, Any]] | None = None, actor: str | None = None,
                    wait_s: float = ACTOR_EXIT_WAIT_S) -> Path | None:
        """Write the dump (after waiting up to ``wait_s`` for the actors that are exiting); the
        path, or None without a folder or when it cannot be written (logged). ``actor``: the
        root cause when no actor died (``ingress`` for a SIGQUIT it received)."""
        if self.folder is None:
            return None
        requests = self.snapshot() if requests is None else requests
        schedulers = [actor for actor in self.actors if actor.name.startswith("scheduler")]
        with trio.CancelScope(shield=True), trio.move_on_after(wait_s):  # bounded: a second signal waits for it
            while any(actor.popen.poll() is None for actor in schedulers):  # one that follows writes on its way out
                await trio.sleep(0.02)
        try:
            dump = self.build(reason, died=died, message=message, requests=requests, actor=actor)
            path = write_crash_dump(self.folder, dump, server_dump_name())
        except Exception as exc:  # noqa: BLE001 - a failing dump must not hide the failure itself
            self.log.error("could not write the crash dump", error=repr(exc))
            return None
        self.log.error("crash dump written", path=str(path), reason=reason.value, root_cause=dump["actor"])
        return path

    def build(self, reason: DumpReason, *, died: ActorDied | None, message: str | None,
              requests: list[dict[str, Any]], actor: str | None = None) -> dict[str, Any]:
        """The dump's content (no waiting, no writing)."""
        assert self.folder is not None
        message = message or (died.summary if died is not None else reason.value)
        dump = dump_header(writer="supervisor", reason=reason, message=message, actor=died.actor if died else actor)
        parts = {}
        for actor in self.actors:
            found = find_actor_dumps(self.folder, actor.name, actor.pid)
            if found:
                try:
                    parts[actor.name] = (found[-1], read_crash_dump(found[-1]))
                except (OSError, ValueError) as exc:
                    self.log.warning("an actor's crash dump cannot be read", path=str(found[-1]), error=str(exc))
        scheduler_part = next((part for name, part in parts.items() if name.startswith("scheduler")), None)
        traces = self._native_traces()
        device = {key: value for actor in self.actors for key, value in actor.ready_info.items() if key == "device"}
        dump.update({
            "failure": None if died is None else self._failure(died, traces),
            "actors": [{"name": "ingress", "pid": os.getpid(), "state": "running", "role": "supervisor"}]
                      + [self._actor(actor, died) for actor in self.actors],
            "server_args": mask_secrets(self.server_args),
            "versions": versions(device) | ((scheduler_part[1].get("versions") or {}) if scheduler_part else {}),
            "scheduler": scheduler_part[1].get("scheduler") if scheduler_part else None,
            "scheduler_source": str(scheduler_part[0]) if scheduler_part else
                                "none: the scheduler did not write its state (killed, or still running)",
            "pending_requests": _merge_scheduler_view(requests, scheduler_part[1].get("scheduler") if scheduler_part else None),
            "recent_requests": scheduler_part[1].get("recent_requests", []) if scheduler_part else [],
            "log_requests_level": self.level,
            "native_traces": {name: str(path) for name, (path, _) in traces.items()},
            "parts": [str(path) for path, _ in parts.values()],
        })
        return dump

    def _native_traces(self) -> dict[str, tuple[Path, str]]:
        """Each actor's faulthandler file that holds something; empty ones are removed."""
        assert self.folder is not None
        found = {}
        for actor in self.actors:
            path = native_trace_path(self.folder, actor.name, actor.pid)
            text = read_native_trace(path)
            if text:
                found[actor.name] = (path, text)
            elif actor.popen.poll() is not None:
                remove_if_empty(path)
        return found

    def _failure(self, died: ActorDied, traces: dict[str, tuple[Path, str]]) -> dict[str, Any]:
        code = died.returncode
        report = died.report or {}
        trace = traces.get(died.actor)
        return {
            "actor": died.actor,
            "returncode": code,
            "signal": None if code is None or code >= 0 else _signal_name(-code),
            "exception": {k: report.get(k) for k in ("type", "message", "traceback")} if report.get("kind") == "exception" else None,
            "stopped_by": report.get("signal") if report.get("kind") == "signal" else None,
            # the watchdog's findings (app/actors/watchdog.py): how long, and what was waiting
            "stall": ({k: v for k, v in report.items() if k not in ("kind", "time")}
                      if report.get("kind") == "stall" else None),
            "native_traceback": trace[1] if trace else None,
            "native_traceback_path": str(trace[0]) if trace else None,
            "stderr_tail": died.stderr_tail,
        }

    def _actor(self, actor: ActorProcess, root: ActorDied | None) -> dict[str, Any]:
        report = actor.report
        return {
            "name": actor.name,
            "pid": actor.pid,
            "state": _actor_state(actor, root),
            "returncode": actor.popen.returncode,
            "report": None if report is None else {k: v for k, v in report.items() if k != "traceback"},
            "startup_s": actor.ready_info.get("startup_s"),
            "rss_mb": actor.ready_info.get("rss_mb"),
        }


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
