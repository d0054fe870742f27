"""Crash dumps: what the server knew when it failed, written where ``--crash-dump-folder`` says.

One JSON file per failure (``crash_dump_<UTC time>_<pid>.json``), written to a temporary
name and renamed, so a reader never sees half a dump. Tools read it back with ``read_crash_dump``.

A dump holds prompts, so it is created readable by its owner only (0600). It never holds the
command line or the environment (keys can be there): ``server_args`` shows only whether each
key is set.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1


def write_crash_dump(folder: str | Path, *, reason: str, details: dict[str, Any], pending: list[dict[str, Any]],
                     server_args: dict[str, Any]) -> Path:
    """Write a dump and return its path. Raises OSError when the folder cannot be written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = folder / f"crash_dump_{stamp}_{os.getpid()}.json"
    dump = {
        "format_version": FORMAT_VERSION,
        "time": time.time(),
        "reason": reason,
        "details": details,
        "pending_requests": pending,
        "server_args": server_args,
        "pid": os.getpid(),
    }
    text = json.dumps(dump, indent=1, default=str).encode()
    temporary = path.with_suffix(".json.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(descriptor, 0o600)  # a file left by an earlier attempt keeps its mode otherwise
        with os.fdopen(descriptor, "wb") as file:
            file.write(text)
        temporary.replace(path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def read_crash_dump(path: str | Path) -> dict[str, Any]:
    """Load a dump; ValueError when it is not one."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "format_version" not in data:
        raise ValueError(f"{path}: not a crash dump")
    return data
