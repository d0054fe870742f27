"""Supervision with tiny real child processes: start-up, failures, stopping, parent death."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import trio

from app.actors.process import ActorDied, ActorLaunch, ActorStartError, spawn_actor
from app.actors.supervisor import Supervisor, first_failure

_PR_SET_CHILD_SUBREAPER = 36
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def launch(name: str, mode: str) -> ActorLaunch:
    return ActorLaunch(name, "tiny_actor", msgspec.json.encode({"mode": mode}),
                       env={"PYTHONPATH": f"{HERE}:{ROOT}"})


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return status != "Z"


def run_supervised(modes: dict[str, str], body, **options):
    """Spawn (from this main thread), then run ``body(supervisor, nursery)`` under trio."""
    actors = [spawn_actor(launch(name, mode)) for name, mode in modes.items()]
    supervisor = Supervisor(actors, **options)
    try:
        async def main():
            async with trio.open_nursery() as nursery:
                return await body(supervisor, nursery)

        return trio.run(main), actors
    finally:
        supervisor.close()
        for actor in actors:
            assert not alive(actor.pid)


def test_actors_start_report_ready_and_stop_cleanly():
    async def body(supervisor, nursery):
        infos = await nursery.start(supervisor.run)
        for actor in supervisor.actors:
            cmdline = Path(f"/proc/{actor.pid}/cmdline").read_bytes().split(b"\0")
            assert f"app::{actor.name}".encode() in cmdline  # ps shows which actor is which
        nursery.cancel_scope.cancel()
        return infos

    infos, actors = run_supervised({"tokenizer": "ok", "detokenizer": "ok"}, body)
    for actor in actors:
        info = infos[actor.name]
        assert (info["pid"], info["mode"]) == (actor.pid, "ok")
        assert 0 < info["startup_s"] < 60 and 5 < info["rss_mb"] < 1000  # measured by the actor itself
    assert [a.popen.returncode for a in actors] == [0, 0]  # SIGTERM: a clean exit
    assert any("serving" in line and "app::tokenizer" in line for line in actors[0].stderr_tail)


def test_a_child_that_fails_to_start_is_a_clear_error_with_its_stderr():
    async def body(supervisor, nursery):
        with pytest.raises(ActorStartError) as info:
            await nursery.start(supervisor.run)
        return str(info.value)

    message, _ = run_supervised({"tokenizer": "ok", "scheduler_TP0": "crash_at_start"}, body, ready_timeout=30)
    assert "app::scheduler_TP0 exited with code 3 during start-up" in message
    assert "weights are missing" in message


def test_a_child_that_never_reports_ready_times_out():
    async def body(supervisor, nursery):
        with pytest.raises(ActorStartError, match=r"app::slow did not report ready within 1 s"):
            await nursery.start(supervisor.run)

    run_supervised({"slow": "never_ready"}, body, ready_timeout=1)


def test_a_child_dying_later_runs_the_failure_hook_stops_the_rest_and_raises():
    seen: list[ActorDied] = []

    async def on_failure(died):
        seen.append(died)

    async def body(supervisor, nursery):
        with pytest.raises(BaseExceptionGroup) as info:
            async with trio.open_nursery() as inner:
                await inner.start(supervisor.run)
        return first_failure(info.value)

    died, actors = run_supervised({"tokenizer": "ok", "scheduler_TP0": "die_later"}, body, on_failure=on_failure)
    assert seen == [died]
    assert died.actor == "scheduler_TP0" and died.returncode == 1
    assert "the tiny actor failed on purpose" in died.stderr_tail
    assert actors[0].popen.returncode == 0  # the healthy one was stopped cleanly


def test_a_child_ignoring_sigterm_is_killed_after_the_grace_period():
    async def body(supervisor, nursery):
        await nursery.start(supervisor.run)
        start = trio.current_time()
        nursery.cancel_scope.cancel()
        return start

    _, actors = run_supervised({"stubborn": "ignore_term"}, body, stop_grace=0.5)
    assert actors[0].popen.returncode == -signal.SIGKILL


def test_children_die_within_two_seconds_of_a_sigkilled_parent():
    # Become the subreaper of the orphans, so that we can reap them (no zombies left behind).
    libc = ctypes.CDLL(None)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    parent = subprocess.Popen([sys.executable, str(HERE / "parent.py")], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 2.0
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(alive(pid) for pid in pids), "a child outlived its SIGKILLed parent by 2 s"
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
