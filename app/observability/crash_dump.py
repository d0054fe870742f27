"""Crash dumps: what the server knew when it failed, written where ``--crash-dump-folder`` says.

One JSON file per writer and failure, written to a temporary name and renamed (a reader never
sees half a dump), created readable by its owner only (0600: it holds prompts). Two writers:

- the supervisor (the ingress process) writes the server-level dump,
  ``crash_dump_<UTC time>_<pid>.json`` (server_dump.py);
- the scheduler writes its own view when it can (an exception in a step, a peer it follows),
  ``actor_dump_<actor>_<pid>_<UTC time>.json`` (scheduler_dump.py), which the supervisor's
  dump merges and names in ``parts``.

Both are schema 2 (docs/crash-dumps.md lists every field). :func:`read_crash_dump` reads
schema 1 too (the first version: ``format_version``, a ``reason`` string, ``details``) and
gives it the shape of schema 2, so that tools read one shape.

A dump never holds the command line or the environment (keys can be there); settings go
through :func:`mask_secrets`.
"""

from __future__ import annotations

import enum
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

FORMAT = "app-crash-dump"
SCHEMA_VERSION = 2
FORMAT_VERSION = SCHEMA_VERSION  # the name schema 1 used
SERVER_DUMP_PREFIX = "crash_dump"
ACTOR_DUMP_PREFIX = "actor_dump"
MASKED = "<set>"
# Setting names whose values are secrets: shown as "<set>" (or null when unset), never as they are.
_SECRET_NAME = re.compile(r"(^|_)(api_?key|key|secret|password|passwd|token|credentials?|authorization)$", re.I)


class DumpReason(enum.Enum):
    """Why a dump was written (its ``reason.kind``)."""

    ACTOR_DIED = "actor_died"  # a child process exited unasked (the supervisor's dump)
    SCHEDULER_EXCEPTION = "scheduler_exception"  # a step raised (the scheduler's own dump)
    PEER_DIED = "peer_died"  # the scheduler stopped because a peer died (its own view of that moment)
    WATCHDOG = "watchdog"  # the scheduler made no progress for --watchdog-timeout
    SIGQUIT = "sigquit"  # an operator asked for a dump and a stop
    REQUESTED = "requested"  # the supervisor asked the scheduler for its view (for a watchdog or SIGQUIT dump)


def _stamp(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))


def server_dump_name(now: float | None = None, pid: int | None = None) -> str:
    return f"{SERVER_DUMP_PREFIX}_{_stamp(now or time.time())}_{pid or os.getpid()}.json"


def actor_dump_name(actor: str, now: float | None = None, pid: int | None = None) -> str:
    return f"{ACTOR_DUMP_PREFIX}_{actor}_{pid or os.getpid()}_{_stamp(now or time.time())}.json"


def find_actor_dumps(folder: str | Path, actor: str, pid: int) -> list[Path]:
    """The dumps process ``pid`` (``actor``) wrote in ``folder``, oldest first."""
    return sorted(Path(folder).glob(f"{ACTOR_DUMP_PREFIX}_{actor}_{pid}_*.json"))


def dump_header(*, writer: str, reason: DumpReason, message: str, actor: str | None) -> dict[str, Any]:
    """The fields every schema-2 dump starts with. ``actor`` is the root cause (None when the
    writer does not know it: a scheduler that only followed a dead peer)."""
    now = time.time()
    return {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "time": now,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "writer": writer,
        "pid": os.getpid(),
        "reason": {"kind": reason.value, "message": message},
        "actor": actor,
    }


def versions(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Python, the package, torch (without importing it where it is not loaded), the OS; plus
    ``extra`` (the device, from the scheduler)."""
    from importlib import metadata

    found: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name, package in (("app", "app"), ("torch", "torch")):
        try:
            found[name] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[name] = None
    torch = sys.modules.get("torch")
    if torch is not None:
        found["torch"] = torch.__version__
        found["cuda"] = torch.version.cuda
    found.update(extra or {})
    return found


def _mask_url(value: str) -> str:
    """A URL without the password of its user-info part."""
    try:
        parts = urlsplit(value)
    except ValueError:
        return value
    if parts.password is None:
        return value
    host = parts.hostname or ""
    netloc = f"{parts.username}:{MASKED}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def mask_secrets(value: Any, name: str = "") -> Any:
    """``value`` with every secret replaced by ``"<set>"``: values of settings named like a key,
    token, secret or password (``max_total_tokens`` is not: the name must end so), objects
    that say they are secrets (app.http.auth.Secret), and passwords inside URLs."""
    if isinstance(value, dict):
        return {key: mask_secrets(item, str(key)) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask_secrets(item, name) for item in value]
    if value is None or isinstance(value, bool):
        return value
    if _SECRET_NAME.search(name) or type(value).__name__ == "Secret":
        return MASKED
    if isinstance(value, str) and "@" in value and "://" in value:
        return _mask_url(value)
    return value


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def encode_dump(dump: dict[str, Any]) -> bytes:
    """Compact strict JSON (no NaN), anything unknown as its text (tools/postmortem.py is the
    way to read a dump; `python -m json.tool` indents one)."""
    try:
        return json.dumps(dump, separators=(",", ":"), default=str, allow_nan=False).encode()
    except ValueError:
        return json.dumps(_finite(dump), separators=(",", ":"), default=str, allow_nan=False).encode()


def prepare_dump_folder(folder: str | None) -> None:
    """Create ``--crash-dump-folder`` (0700) at start and check that it can be written: a dump
    that cannot be written is found out now, not at the crash. ValueError naming the flag."""
    if folder is None:
        return
    try:
        Path(folder).mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--crash-dump-folder {folder!r} cannot be created: {exc.strerror}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--crash-dump-folder {folder!r} is not writable")


def write_crash_dump(folder: str | Path, dump: dict[str, Any], filename: str | None = None) -> Path:
    """Write ``dump`` atomically (temporary file, then rename) with mode 0600; return its path.
    Raises OSError when the folder cannot be written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (filename or server_dump_name())
    text = encode_dump(dump)
    temporary = path.with_name(f".{path.name}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(descriptor, 0o600)  # a file left by an earlier attempt keeps its mode otherwise
        with os.fdopen(descriptor, "wb") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        temporary.replace(path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def _upgrade_schema_1(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 dump in the shape of schema 2 (what it did not record is absent)."""
    details = data.get("details") or {}
    return {
        "format": FORMAT,
        "schema_version": 1,
        "time": data.get("time"),
        "writer": "supervisor",
        "pid": data.get("pid"),
        "reason": {"kind": DumpReason.ACTOR_DIED.value, "message": data.get("reason")},
        "actor": details.get("actor"),
        "failure": {"actor": details.get("actor"), "returncode": details.get("returncode"),
                    "stderr_tail": details.get("stderr_tail")},
        "pending_requests": data.get("pending_requests") or [],
        "server_args": data.get("server_args") or {},
    }


def read_crash_dump(path: str | Path) -> dict[str, Any]:
    """Load a dump of any schema version, in the shape of schema 2; ValueError (saying why) when
    the file is not a crash dump, OSError when it cannot be read."""
    raw = Path(path).read_bytes()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a crash dump (not JSON: {exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a crash dump (not a JSON object)")
    if data.get("format") == FORMAT and isinstance(data.get("schema_version"), int):
        if data["schema_version"] > SCHEMA_VERSION:
            raise ValueError(f"{path}: crash dump schema {data['schema_version']} is newer than this "
                             f"tool's ({SCHEMA_VERSION})")
        return data
    if data.get("format_version") == 1 and "reason" in data:
        return _upgrade_schema_1(data)
    raise ValueError(f"{path}: not a crash dump (no format and schema_version fields)")
