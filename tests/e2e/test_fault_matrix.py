"""The fault matrix: each actor (tokenizer, scheduler, detokenizer) fails in each way, under
streaming load, in a real server.

Faults from the inside (``APP_FAULT``, app/actors/faults.py): the actor raises, exits, hangs or
segfaults at its work point. From the outside: SIGKILL, SIGSTOP, SIGQUIT. For every case: each
client gets an answer (an SSE error event then ``[DONE]``, or a 5xx JSON body; a request that
finished before the fault may have its normal answer), at least one names the actor, all within
5 s of the load (a hang: the watchdog timeout + 5 s); the dump exists, ``tools/postmortem.py``
reads it and names the actor; the server exits 1; no process and no /dev/shm name remains.

The three actors of one fault run at once, one server each (one test per fault): a server
start costs seconds on two cores, the faults themselves milliseconds. The watchdog timeout is
short (``HANG_TIMEOUT_S``) where the fault is a hang or a stop; elsewhere it keeps its default,
so that a slow CI machine cannot trip it.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import threading
import time
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from server import ServerProcess, alive, reap, stream_in_thread, wait_until

ROOT = Path(__file__).resolve().parents[2]
ACTORS = ("tokenizer", "scheduler_TP0", "detokenizer")
FAULTS = ("raise", "exit", "segfault", "hang", "SIGKILL", "SIGSTOP", "SIGQUIT")
HANG_TIMEOUT_S = 1.5  # --watchdog-timeout of the hang and SIGSTOP cases
ANSWER_WITHIN_S = 5.0
MAX_TOKENS = 400  # a stream long enough to be in flight at the fault (~1 s on two cores)
# Where the inside fault fires: the third client request the tokenizer takes (the warm-up sends
# four, the two streams are the 5th and 6th), a step or a step's outputs in the middle of the streams.
FAULT_AT = {"tokenizer": "tokenizer:request:{action}:7", "scheduler_TP0": "scheduler:step:{action}:120",
            "detokenizer": "detokenizer:output:{action}:120"}


def _load_postmortem():
    spec = importlib.util.spec_from_file_location("postmortem", ROOT / "tools/postmortem.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


postmortem = _load_postmortem()


def summary_of(victim: str, fault: str) -> str:
    """The start of what the clients, the log and the dump say of the root cause."""
    title = f"app::{victim}"
    return {
        "raise": f"{title} raised InjectedFault (exit code 1)",
        "exit": f"{title} exited with code 3",
        "segfault": f"{title} was killed by signal SIGSEGV",
        "hang": f"{title} made no progress for ",
        "SIGKILL": f"{title} was killed by signal SIGKILL",
        "SIGSTOP": f"{title} made no progress for ",
        "SIGQUIT": f"{title} stopped on SIGQUIT (exit code 1)",
    }[fault]


@dataclass
class Case:
    """One server with one fault, and what its clients got."""

    victim: str
    fault: str
    dumps: Path
    server: ServerProcess
    actors: dict[str, int] = field(default_factory=dict)
    streams: list[list[str]] = field(default_factory=list)
    responses: list[httpx.Response | str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    load_at: float = 0.0
    answered_at: list[float] = field(default_factory=list)
    exit_code: int | None = None
    error: BaseException | None = None  # what went wrong in the thread that drove it

    @property
    def watchdog(self) -> bool:
        return self.fault in ("hang", "SIGSTOP")

    def stream(self) -> threading.Event:
        events: list[str] = []
        self.streams.append(events)
        started = threading.Event()

        self.threads.append(stream_in_thread(self.server.url, {
            "model": "tiny-llama-v1", "prompt": "a streamed prompt", "max_tokens": MAX_TOKENS, "stream": True,
            "ignore_eos": True}, events, started, on_end=lambda: self.answered_at.append(time.monotonic())))
        return started

    def _all_in_flight(self) -> bool:
        """Whether the server holds both streams and the plain request."""
        info = httpx.get(f"{self.server.url}/server_info", timeout=5).json()
        return info.get("requests_in_flight", 0) >= 3

    def post(self) -> None:
        def send() -> None:
            try:
                with httpx.Client(timeout=60) as http:
                    self.responses.append(http.post(f"{self.server.url}/generate", json={
                        "text": "a plain prompt",
                        "sampling_params": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True}}))
            except httpx.HTTPError as exc:
                self.responses.append(f"transport error: {exc!r}")
            self.answered_at.append(time.monotonic())

        self._start(send)

    def _start(self, target) -> None:  # noqa: ANN001 - a thread's body
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        self.threads.append(thread)

    def drive(self) -> None:
        """:meth:`load_and_fault`, in a thread of its own: a failure is kept for the test."""
        try:
            self.load_and_fault()
        except BaseException as exc:  # noqa: BLE001 - raised again by the test
            self.error = exc

    def load_and_fault(self) -> None:
        """Two streams, then a plain request; the outside fault once they run."""
        self.actors = self.server.actor_pids()
        firsts = [self.stream(), self.stream()]
        assert all(first.wait(30) for first in firsts), self.server.log()
        self.load_at = time.monotonic()
        self.post()
        if self.fault.startswith("SIG"):
            # The plain request in flight first (its thread may take a while to connect on a
            # busy machine): a request that reaches a server already stopping is another case.
            assert wait_until(self._all_in_flight, timeout=10, interval=0.01), self.server.log()
            os.kill(self.actors[self.victim], getattr(signal, self.fault))
            if self.fault == "SIGSTOP":
                self.post()  # work for a stopped idle actor: what makes its stall visible
        self.exit_code = self.server.wait(timeout=60)
        for thread in self.threads:
            thread.join(timeout=10)


def _start(fault: str, victim: str, cache_dir: Path, tmp_path: Path) -> Case:
    dumps = tmp_path / f"dumps-{victim}"
    env = {"APP_FAULT": FAULT_AT[victim].format(action=fault)} if not fault.startswith("SIG") else {}
    flags = ["--crash-dump-folder", str(dumps), "--context-length", "1024"]
    if fault in ("hang", "SIGSTOP"):
        flags += ["--watchdog-timeout", str(HANG_TIMEOUT_S)]
    return Case(victim, fault, dumps, ServerProcess(*flags, cache_dir=cache_dir, env=env))


def _check_answers(case: Case, summary: str) -> None:
    """Every client answered, at least one naming the root cause, all in time."""
    named = 0
    for events in case.streams:
        assert events and events[-1] == "[DONE]", (case.victim, case.fault, events[-3:])
        last = json.loads(events[-2])
        if "error" in last:
            message = last["error"]["message"]
            assert message.startswith(f"The server failed: {summary}"), message
            named += 1
        else:  # it finished before the fault was seen
            assert last["choices"][0]["finish_reason"] == "length", last
    for response in case.responses:
        assert isinstance(response, httpx.Response), response
        if response.status_code >= 500:
            message = response.json()["message"]
            assert message.startswith("The server failed: ") or "shutting down" in message, message
            named += message.startswith(f"The server failed: {summary}")
        else:
            assert response.status_code == 200, response.text
    assert named >= 1, (case.streams, case.responses)
    limit = ANSWER_WITHIN_S + (HANG_TIMEOUT_S if case.watchdog else 0)
    assert max(case.answered_at) - case.load_at < limit, "the clients waited too long"


def _check_dump(case: Case, summary: str) -> None:
    [dump_file] = list(case.dumps.glob("crash_dump_*.json"))
    dump = json.loads(dump_file.read_text())
    assert dump["actor"] == case.victim and dump["reason"]["message"].startswith(summary)
    assert dump["reason"]["kind"] == ("watchdog" if case.watchdog else "actor_died")
    failure = dump["failure"]
    if case.watchdog:
        assert failure["stall"]["stalled_s"] >= HANG_TIMEOUT_S
        if case.fault == "hang":  # it still answers: its stacks show where it waits
            assert "in _hang" in failure["native_traceback"]
        if case.victim == "scheduler_TP0" and case.fault == "hang":  # and the scheduler wrote its view
            assert dump["scheduler"]["kv_pool"]["used"] > 0 and dump["scheduler"]["running_batch"]
    elif case.fault == "segfault":
        assert failure["signal"] == "SIGSEGV" and "Segmentation fault" in failure["native_traceback"]
    elif case.fault == "raise":
        assert failure["exception"]["type"] == "InjectedFault"
    if case.victim == "scheduler_TP0" and case.fault in ("raise", "SIGQUIT"):  # its own view, merged
        assert dump["scheduler"]["counters"]["forward_steps"] > 0, dump["scheduler_source"]
    text = io.StringIO()
    with redirect_stdout(text):
        assert postmortem.main(["--json", str(dump_file)]) == 0
    [read] = json.loads(text.getvalue())
    assert read["actor"] == case.victim and read["what_happened"].startswith(summary)
    human = io.StringIO()
    with redirect_stdout(human):
        assert postmortem.main([str(dump_file)]) == 0
    assert f"Root cause: app::{case.victim}" in human.getvalue()


def _check_nothing_left(case: Case) -> None:
    for name, pid in case.actors.items():
        assert wait_until(lambda: not alive(pid), timeout=5), f"{name} outlived the server"
        reap(pid)
    assert not [entry for entry in os.listdir("/dev/shm") if entry.startswith(f"app-{case.server.popen.pid}-")]


@pytest.mark.parametrize("fault", FAULTS)
def test_each_actor_failing_so_answers_every_client_dumps_and_exits_one(fault, cache_dir, tmp_path):
    cases = [_start(fault, victim, cache_dir, tmp_path) for victim in ACTORS]  # they start side by side
    try:
        for case in cases:
            case.server.wait_serving()
        drivers = [threading.Thread(target=case.drive) for case in cases]
        for driver in drivers:
            driver.start()
        for driver in drivers:
            driver.join(timeout=90)
        for case in cases:
            if case.error is not None:
                raise case.error
            summary = summary_of(case.victim, fault)
            assert case.exit_code == 1, case.server.log()
            _check_answers(case, summary)
            _check_dump(case, summary)
            _check_nothing_left(case)
    finally:
        for case in cases:
            case.server.stop()


def test_sigquit_to_the_server_dumps_everything_answers_every_client_and_exits_one(cache_dir, tmp_path):
    case = Case("ingress", "SIGQUIT", tmp_path / "dumps",
                ServerProcess("--crash-dump-folder", str(tmp_path / "dumps"), "--context-length", "1024",
                              cache_dir=cache_dir))
    try:
        case.server.wait_serving()
        case.actors = case.server.actor_pids()
        firsts = [case.stream(), case.stream()]
        assert all(first.wait(30) for first in firsts)
        case.load_at = time.monotonic()
        case.post()
        time.sleep(0.1)
        case.server.signal(signal.SIGQUIT)
        assert case.server.wait(timeout=30) == 1, case.server.log()
        for thread in case.threads:
            thread.join(timeout=10)
        assert "SIGQUIT received: writing a crash dump and stopping" in case.server.log()
        summary = "the ingress received SIGQUIT"
        _check_answers(case, summary)
        [dump_file] = list(case.dumps.glob("crash_dump_*.json"))
        dump = json.loads(dump_file.read_text())
        assert dump["reason"] == {"kind": "sigquit", "message": summary} and dump["actor"] == "ingress"
        # Every actor's stacks, and the scheduler's view of the moment, asked for before the stop.
        assert set(dump["native_traces"]) == set(ACTORS)
        assert all("Current thread" in Path(path).read_text() for path in dump["native_traces"].values())
        assert dump["scheduler"]["running_batch"] and dump["scheduler"]["kv_pool"]["used"] > 0
        assert len(dump["pending_requests"]) == 3
        human = io.StringIO()
        with redirect_stdout(human):
            assert postmortem.main([str(dump_file)]) == 0
        assert "Root cause: app::ingress" in human.getvalue() and summary in human.getvalue()
        _check_nothing_left(case)
    finally:
        case.server.stop()
