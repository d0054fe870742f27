"""The offline engine on the HTTP levels' workload: ``tools/bench_offline.py`` as a subprocess,
with the launched server's engine flags, after the server has stopped (the two would share the
device and its memory).

Same workload: ``--num-prompts``, the input and output lengths (the nominal ones: bench_offline's
lengths are fixed, so with ``--random-range-ratio`` below 1 the offline run is the longest
case), greedy, EOS ignored. One run per distinct concurrency cap of the levels: a level capped at
C in flight is compared with the engine decoding at most C at once (``--max-running-requests``,
at most the server's own), an uncapped level with the server's flags as given. The ratio is
the level's output tokens/s over the offline run's; a level sent at a finite request rate is
bounded by its rate, so its ratio says little.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import MISSING
from pathlib import Path
from typing import Any

from app.engine.config import EngineConfig
from app.flags import add_flags, flag_fields, flag_values

BENCH_OFFLINE = Path(__file__).resolve().parents[1] / "bench_offline.py"
# Engine flags that bound the server's queue or time its requests: they mean nothing for one
# offline batch (and a queue bound would refuse its requests).
SERVING_ONLY_ENGINE_FLAGS = frozenset({"max_queued_requests", "waiting_timeout", "request_timeout"})


def offline_flags(server_args: list[str]) -> list[str]:
    """``--model-path`` and the engine flags among the server's flags (every other server flag
    dropped), as bench_offline.py takes them."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model-path", default=None)
    add_flags(parser, EngineConfig)
    try:
        namespace, _ = parser.parse_known_args(server_args)
    except SystemExit:
        raise ValueError(f"--offline: the server flags {server_args!r} do not parse as engine flags") from None
    flags = ["--model-path", namespace.model_path] if namespace.model_path else []
    values = flag_values(namespace, EngineConfig)
    for field in flag_fields(EngineConfig):
        value = values.get(field.name)
        default = None if field.default is MISSING else field.default
        if field.name in SERVING_ONLY_ENGINE_FLAGS or value is None or value == default:
            continue
        name = "--" + field.name.replace("_", "-")
        flags += [name] if value is True else [name, str(value)]
    return flags


def engine_max_running(flags: list[str]) -> int | None:
    """``--max-running-requests`` among bench_offline flags (None: not given)."""
    if "--max-running-requests" in flags:
        return int(flags[flags.index("--max-running-requests") + 1])
    return None


def with_max_running(flags: list[str], cap: int | None) -> list[str]:
    """``flags`` with ``--max-running-requests cap`` (replacing any), or unchanged for None."""
    if cap is None:
        return flags
    if "--max-running-requests" in flags:
        at = flags.index("--max-running-requests")
        flags = [*flags[:at], *flags[at + 2:]]
    return [*flags, "--max-running-requests", str(cap)]


def offline_cap(level_cap: int | None, server_max_running: int | None) -> int | None:
    """The engine's cap for a level capped at ``level_cap`` (None or 0: uncapped): at most the server's."""
    if not level_cap:
        return None
    return min(level_cap, server_max_running) if server_max_running else level_cap


def run_offline(flags: list[str], num_prompts: int, input_len: int, output_len: int, seed: int,
                timeout: float) -> dict[str, Any]:
    """One bench_offline.py run; its figures (its last stdout line) and its command line.
    RuntimeError when it fails."""
    command = [sys.executable, str(BENCH_OFFLINE), *flags, "--num-prompts", str(num_prompts),
               "--input-len", str(input_len), "--output-len", str(output_len), "--seed", str(seed)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)  # killed on any error
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"--offline: bench_offline.py ran past {timeout:g} s") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"--offline: bench_offline.py exited {done.returncode}: {done.stderr[-2000:]}")
    figures = json.loads(lines[-1])
    return {"command": command[1:], **figures}
