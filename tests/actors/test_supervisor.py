"""Supervision with tiny real child processes: start-up, failures, stopping by the deadline, parent death."""

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
import trio.testing

from app.actors.process import ActorDied, ActorLaunch, ActorStartError, spawned_actors
from app.actors.supervisor import Supervisor
from app.errors import find_exception
from app.shutdown import ShutdownDeadline

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
    """Spawn (from this main thread), then run ``body(supervisor)`` under trio."""
    with spawned_actors(launch(name, mode) for name, mode in modes.items()) as actors:
        supervisor = Supervisor(actors, **options)
        result = trio.run(body, supervisor)
    for actor in actors:
        assert not alive(actor.pid)
    return result, actors


def test_actors_start_report_ready_and_stop_cleanly_when_the_block_ends():
    async def body(supervisor):
        async with supervisor.supervising() as infos:
            for actor in supervisor.actors:
                cmdline = Path(f"/proc/{actor.pid}/cmdline").read_bytes().split(b"\0")
                assert f"app::{actor.name}".encode() in cmdline  # ps shows which actor is which
        assert all(actor.popen.returncode is not None for actor in supervisor.actors)  # reaped inside
        return infos

    infos, actors = run_supervised({"tokenizer": "ok", "detokenizer": "ok"}, body)
    for actor in actors:
        info = infos[actor.name]
        assert (info["pid"], info["mode"]) == (actor.pid, "ok")
        assert 0 < info["startup_s"] < 60 and 5 < info["rss_mb"] < 1000  # measured by the actor itself
    assert [a.popen.returncode for a in actors] == [0, 0]  # SIGTERM: a clean exit
    assert any("serving" in line and "app::tokenizer" in line for line in actors[0].stderr_tail)


def test_a_cancelled_block_still_stops_and_reaps_every_actor():
    async def body(supervisor):
        with trio.CancelScope() as scope:
            async with supervisor.supervising():
                scope.cancel()
                await trio.sleep_forever()
        return [actor.popen.returncode for actor in supervisor.actors]

    codes, _ = run_supervised({"tokenizer": "ok", "detokenizer": "ok"}, body)
    assert codes == [0, 0]


def test_a_child_that_fails_to_start_is_a_clear_error_with_its_stderr():
    async def body(supervisor):
        with pytest.raises(BaseExceptionGroup) as info:
            async with supervisor.supervising():
                pytest.fail("the block ran although an actor failed to start")
        return find_exception(info.value, ActorStartError)

    failure, actors = run_supervised({"tokenizer": "ok", "scheduler_TP0": "crash_at_start"}, body, ready_timeout=30)
    assert "app::scheduler_TP0 exited with code 3 during start-up" in str(failure)
    assert "weights are missing" in str(failure)
    assert actors[0].popen.returncode == 0  # the one that had started was stopped cleanly


def test_a_child_that_never_reports_ready_times_out():
    async def body(supervisor):
        with pytest.raises(BaseExceptionGroup) as info:
            async with supervisor.supervising():
                pass
        return find_exception(info.value, ActorStartError)

    failure, _ = run_supervised({"slow": "never_ready"}, body, ready_timeout=1)
    assert "app::slow did not report ready within 1 s" in str(failure)


def test_a_child_dying_later_is_returned_as_the_death_and_the_rest_are_stopped():
    async def body(supervisor):
        async with supervisor.supervising():
            with trio.fail_after(30):
                return await supervisor.wait_for_death()

    died, actors = run_supervised({"tokenizer": "ok", "scheduler_TP0": "die_later"}, body)
    assert isinstance(died, ActorDied)
    assert died.actor == "scheduler_TP0" and died.returncode == 1
    assert "the tiny actor failed on purpose" in died.stderr_tail
    assert actors[0].popen.returncode == 0  # the healthy one was stopped cleanly


def test_the_death_reported_is_the_actor_that_failed_not_one_that_exited_0_before_it():
    async def body(supervisor):
        async with supervisor.supervising():
            with trio.fail_after(30):
                return await supervisor.wait_for_death()

    died, actors = run_supervised({"detokenizer": "exit_soon", "scheduler_TP0": "fail_slowly"}, body)
    follower, failed = actors
    assert follower.popen.returncode == 0 and failed.popen.returncode == 1  # the follower exited first
    assert died.actor == "scheduler_TP0" and died.own_failure
    assert died.summary == "app::scheduler_TP0 raised RuntimeError (exit code 1)"
    assert died.report["message"] == "the tiny actor failed slowly"
    assert "RuntimeError: the tiny actor failed slowly" in died.report["traceback"]
    assert not any(line.startswith("APP_FAILURE_REPORT") for line in failed.stderr_tail)  # kept out of the log


def test_a_child_ignoring_sigterm_is_killed_at_the_shutdown_deadline():
    async def body(supervisor):
        async with supervisor.supervising():
            pass
        return trio.current_time() - supervisor.shutdown.start()

    past_deadline, actors = run_supervised({"stubborn": "ignore_term"}, body, shutdown=ShutdownDeadline(0.5))
    assert actors[0].popen.returncode == -signal.SIGKILL
    assert 0 <= past_deadline < 1.0  # killed at the deadline, not later


def test_the_shutdown_deadline_is_fixed_by_the_first_layer_that_stops():
    async def body():
        began = trio.current_time()
        shutdown = ShutdownDeadline(2.0)
        first = shutdown.start()
        await trio.sleep(1.0)
        return first - began, shutdown.start() - began

    first, later = trio.run(body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert first == later == 2.0
    with pytest.raises(ValueError, match="shutdown timeout"):
        ShutdownDeadline(-1)


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
