"""Read crash dumps: what died and why, the last requests, the pool and queue, the traceback.

    python tools/postmortem.py DUMP [DUMP...] [--json] [--requests N]

For each dump (a server's ``crash_dump_*.json`` or an actor's own ``actor_dump_*.json``, of
any schema version) it prints a summary for a human: the actor that failed first and how (its
exception, or the signal or exit code), the state of the other actors, the versions, the
scheduler's running batch, waiting queue and KV pool at the crash, the requests in flight, a
timeline of the last requests (arrival, first token, end, relative to the crash), and the
traceback (Python, then the native one that faulthandler wrote). ``--json`` prints the same
summary as one JSON document (a list, one entry per dump). A file that is not a crash dump is
refused with a message saying why; the exit code is then 2 (0 otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.observability.crash_dump import read_crash_dump  # noqa: E402

EXIT_NOT_A_DUMP = 2


def _how(dump: dict[str, Any]) -> str:
    """One line: who failed and how."""
    reason = dump.get("reason") or {}
    message = reason.get("message") or reason.get("kind") or "unknown"
    actor = dump.get("actor")
    if actor is None and reason.get("kind") == "peer_died":
        return f"{dump.get('writer')} stopped because a peer died ({message}); the root cause is in the server's dump"
    return message


def _requests(dump: dict[str, Any]) -> list[dict[str, Any]]:
    """Recent and pending requests, one entry per rid (pending wins), by arrival."""
    by_rid: dict[str, dict[str, Any]] = {}
    for record in dump.get("recent_requests") or []:
        if isinstance(record, dict) and "rid" in record:
            by_rid[record["rid"]] = {**record, "where": "finished"}
    for record in dump.get("pending_requests") or []:
        if isinstance(record, dict) and "rid" in record:
            view = record.get("scheduler") or {}
            by_rid[record["rid"]] = {**view, **record, "where": "pending"}
    return sorted(by_rid.values(), key=lambda r: r.get("arrival_time") or r.get("started") or 0)


def _offset(moment: Any, crash: float) -> str:
    return f"{moment - crash:+8.3f}s" if isinstance(moment, (int, float)) and moment else "       -"


def summarize(path: Path, dump: dict[str, Any], last: int) -> dict[str, Any]:
    """What the human summary and --json show of one dump."""
    failure = dump.get("failure") or {}
    scheduler = dump.get("scheduler") if isinstance(dump.get("scheduler"), dict) else None
    crash = dump.get("time") or time.time()
    requests = _requests(dump)
    timeline = []
    for record in requests[-last:]:
        first = record.get("first_token_time") or record.get("first_output_time")
        finish = record.get("finish") or {}
        timeline.append({
            "rid": record["rid"],
            "where": record["where"],
            "state": record.get("state"),
            "arrival_s": None if not record.get("arrival_time") else round(record["arrival_time"] - crash, 3),
            "first_token_s": None if not first else round(first - crash, 3),
            "finished_s": None if not record.get("finished_time") else round(record["finished_time"] - crash, 3),
            "prompt_tokens": record.get("prompt_tokens"),
            "output_tokens": record.get("output_tokens"),
            "finish": finish.get("reason") if isinstance(finish, dict) else finish,
        })
    return {
        "path": str(path),
        "schema_version": dump.get("schema_version"),
        "writer": dump.get("writer"),
        "time": dump.get("time"),
        "reason": (dump.get("reason") or {}).get("kind"),
        "actor": dump.get("actor"),
        "what_happened": _how(dump),
        "exception": failure.get("exception"),
        "signal": failure.get("signal"),
        "returncode": failure.get("returncode"),
        "native_traceback": failure.get("native_traceback"),
        "stderr_tail": failure.get("stderr_tail"),
        "actors": dump.get("actors") or [],
        "versions": dump.get("versions") or {},
        "scheduler": None if scheduler is None else {k: scheduler.get(k) for k in (
            "running_batch", "waiting_queue", "chunked_request", "step_in_flight", "kv_pool", "counters")},
        "pending_requests": len(dump.get("pending_requests") or []),
        "recent_requests": len(dump.get("recent_requests") or []),
        "timeline": timeline,
        "parts": dump.get("parts") or [],
    }


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


def render(summary: dict[str, Any]) -> str:
    """The human summary of one dump."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(summary["time"])) if summary["time"] else "unknown time"
    lines = [f"== {summary['path']}  (schema {summary['schema_version']}, written by {summary['writer']}, {when})",
             f"What died:  {summary['what_happened']}"]
    if summary["actor"]:
        lines.append(f"Root cause: app::{summary['actor']}")
    exception = summary["exception"]
    if exception:
        lines.append(f"Exception:  {exception.get('type')}: {exception.get('message')}")
    if summary["signal"]:
        lines.append(f"Signal:     {summary['signal']}")
    if summary["actors"]:
        states = []
        for actor in summary["actors"]:
            code = actor.get("returncode")
            states.append(f"{actor['name']} {actor.get('state')}" + ("" if code is None else f" (code {code})"))
        lines.append("Actors:     " + "; ".join(states))
    if summary["versions"]:
        lines.append("Versions:   " + ", ".join(f"{k} {v}" for k, v in summary["versions"].items() if v is not None))
    scheduler = summary["scheduler"]
    if scheduler is None:
        lines.append("Scheduler:  its state is not in this dump (it was killed, or did not write it)")
    else:
        running, waiting = scheduler.get("running_batch"), scheduler.get("waiting_queue")
        lines.append(f"Scheduler:  running {len(running) if isinstance(running, list) else running}, "
                     f"waiting {len(waiting) if isinstance(waiting, list) else waiting}, "
                     f"chunked {json.dumps(scheduler.get('chunked_request'))}, "
                     f"step in flight {scheduler.get('step_in_flight')}")
        pool = scheduler.get("kv_pool") or {}
        if "total" in pool:
            lines.append(f"KV pool:    total {pool['total']}, used {pool.get('used')}, free {pool.get('free')}, "
                         f"evictable {pool.get('evictable')}, radix tree {pool.get('radix_tree_tokens')} tokens")
        elif pool:
            lines.append(f"KV pool:    {json.dumps(pool)}")
        counters = scheduler.get("counters") or {}
        if counters:
            lines.append("Counters:   " + ", ".join(f"{k} {v}" for k, v in counters.items()))
    lines.append(f"Requests:   {summary['pending_requests']} in flight at the crash, "
                 f"{summary['recent_requests']} finished in the 5 minutes before")
    if summary["timeline"]:
        lines.append("Timeline (seconds relative to the crash):")
        lines.append("    arrival    first tok  finished  where     state       prompt output finish  rid")
        for entry in summary["timeline"]:
            def at(value: Any) -> str:
                return f"{value:+9.3f}" if isinstance(value, (int, float)) else "        -"
            lines.append(f"    {at(entry['arrival_s'])}  {at(entry['first_token_s'])}  {at(entry['finished_s'])} "
                         f" {entry['where']:<8}  {str(entry['state']):<10} {str(entry['prompt_tokens']):>6} "
                         f"{str(entry['output_tokens']):>6} {str(entry['finish'] or ''):<7} {entry['rid']}")
    if exception and exception.get("traceback"):
        lines.append("Traceback:")
        lines.append(_indent(exception["traceback"]))
    if summary["native_traceback"]:
        lines.append("Native traceback (faulthandler):")
        lines.append(_indent(summary["native_traceback"]))
    elif not exception and summary["stderr_tail"]:
        lines.append("Last stderr lines of the actor:")
        lines.append(_indent(summary["stderr_tail"]))
    if summary["parts"]:
        lines.append("Merged from: " + ", ".join(summary["parts"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dumps", nargs="+", metavar="DUMP", type=Path, help="crash dump files")
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")
    parser.add_argument("--requests", type=int, default=30, help="requests shown in the timeline (the last ones)")
    options = parser.parse_args(argv)
    summaries, refused = [], 0
    for path in options.dumps:
        try:
            dump = read_crash_dump(path)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}" if isinstance(exc, ValueError) else f"error: {path}: {exc.strerror}", file=sys.stderr)
            refused += 1
            continue
        summaries.append(summarize(path, dump, max(0, options.requests)))
    if options.json:
        print(json.dumps(summaries, indent=1))
    elif summaries:
        print("\n\n".join(render(summary) for summary in summaries))
    return EXIT_NOT_A_DUMP if refused else 0


if __name__ == "__main__":
    sys.exit(main())
