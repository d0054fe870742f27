"""Crash dumps through real servers: each fault answers every client naming the actor that
failed first (never one that only followed it), writes a private schema-2 dump with its
traceback (and the scheduler's state when the scheduler could write it), that
tools/postmortem.py reads and tools/replay.py re-sends to a fresh server; nothing is left.

One server per fault (each dies), one fresh server for every replay. The keys are set on the
faulted servers: no dump may hold them.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server import alive, reap, serving, stream_in_thread, wait_until

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-dump-test-5e7b1a"
ADMIN_KEY = "sk-dump-admin-9c2f4d"
AUTH = {"authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 300  # long enough to be in flight at the fault, short enough to replay quickly
FAULT_STEP = 150  # APP_FAULT's step: past the warm-up's (about 15), inside the clients' requests

# victim, how to fault it, what the clients and the dump's summary say of it
FAULTS = [
    ("tokenizer", "SIGKILL", "app::tokenizer was killed by signal SIGKILL"),
    ("scheduler_TP0", "SIGSEGV", "app::scheduler_TP0 was killed by signal SIGSEGV"),
    ("scheduler_TP0", "raise", "app::scheduler_TP0 raised InjectedFault (exit code 1)"),
    ("scheduler_TP0", "SIGTERM", "app::scheduler_TP0 stopped on SIGTERM (exit code 0)"),
]


@pytest.fixture(scope="module")
def fresh_server(cache_dir):
    """The server the dumps' requests are replayed to."""
    with serving("--context-length", "1024", cache_dir=cache_dir) as url:
        yield url


def _stream(url: str, events: list[str], started: threading.Event) -> threading.Thread:
    return stream_in_thread(url, {"model": "tiny-llama-v1", "prompt": "a streamed prompt", "max_tokens": MAX_TOKENS,
                                  "stream": True, "ignore_eos": True}, events, started, headers=AUTH)


def _post(url: str, responses: list[httpx.Response]) -> threading.Thread:
    def post() -> None:
        with httpx.Client(timeout=60) as http:
            responses.append(http.post(f"{url}/generate", headers=AUTH, json={
                "text": "a plain prompt", "sampling_params": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True}}))

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def _postmortem(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "tools/postmortem.py"), *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("victim", "fault", "summary"), FAULTS, ids=[f"{v}-{f}" for v, f, _ in FAULTS])
def test_a_fault_names_its_root_cause_to_clients_and_in_a_dump_that_the_tools_read(
        start_server, fresh_server, tmp_path, victim, fault, summary):
    dumps = tmp_path / "dumps"
    env = {"APP_API_KEY": API_KEY, "APP_ADMIN_API_KEY": ADMIN_KEY}
    if fault == "raise":
        env["APP_FAULT"] = f"scheduler:step:raise:{FAULT_STEP}"
    server = start_server("--crash-dump-folder", str(dumps), "--context-length", "1024", env=env)
    actors = server.actor_pids()
    for name, pid in {"ingress": server.popen.pid, **actors}.items():  # faulthandler in every process
        assert (dumps / f"faulthandler_{name}_{pid}.log").is_file()
    events: list[str] = []
    started = threading.Event()
    responses: list[httpx.Response] = []
    reader, poster = _stream(server.url, events, started), _post(server.url, responses)
    assert started.wait(30), server.log()
    time.sleep(0.1)  # the non-streamed request reaches the scheduler
    faulted_at = time.monotonic()
    if fault != "raise":
        os.kill(actors[victim], getattr(signal, fault))

    assert server.wait(timeout=30) == 1, server.log()
    reader.join(timeout=10)
    poster.join(timeout=10)
    answered_after = time.monotonic() - faulted_at

    # Every client is answered, naming the root cause (never the detokenizer that followed it).
    assert events[-1] == "[DONE]", events[-3:]
    stream_error = json.loads(events[-2])["error"]["message"]
    assert stream_error == f"The server failed: {summary}"
    assert len(responses) == 1 and responses[0].status_code == 500
    assert responses[0].json()["message"] == f"The server failed: {summary}"
    assert answered_after < 5, "the clients waited too long for their answer"
    assert f'server failed error="{summary}' in server.log() or f"server failed error='{summary}" in server.log()

    # One server dump: private, strict JSON, schema 2, naming the root cause and how it failed.
    [dump_file] = list(dumps.glob("crash_dump_*.json"))
    assert stat.S_IMODE(dump_file.stat().st_mode) == 0o600
    text = dump_file.read_text()
    dump = json.loads(text, parse_constant=lambda constant: pytest.fail(f"{constant} in the dump"))
    assert (dump["format"], dump["schema_version"], dump["writer"]) == ("app-crash-dump", 2, "supervisor")
    assert dump["actor"] == victim and dump["reason"] == {"kind": "actor_died", "message": summary}
    failure = dump["failure"]
    assert failure["actor"] == victim
    states = {actor["name"]: actor["state"] for actor in dump["actors"]}
    assert states[victim] == "failed" and list(states.values()).count("failed") == 1
    assert dump["server_args"]["api_key"] == dump["server_args"]["admin_api_key"] == "<set>"
    assert dump["versions"]["python"] and dump["versions"]["torch"] and dump["versions"]["device"] == "cpu"
    pending = {record["rid"]: record for record in dump["pending_requests"]}
    assert len(pending) == 2
    assert {record.get("text") for record in pending.values()} == {"a streamed prompt", "a plain prompt"}
    assert all(record["sampling"]["max_new_tokens"] == MAX_TOKENS for record in pending.values())

    if fault == "raise":
        assert failure["exception"]["type"] == "InjectedFault"
        assert f"InjectedFault: injected fault: step #{FAULT_STEP}" in failure["exception"]["traceback"]
        assert "scheduler.py" in failure["exception"]["traceback"]
    elif fault == "SIGSEGV":
        assert failure["signal"] == "SIGSEGV" and "Segmentation fault" in failure["native_traceback"]
        assert Path(failure["native_traceback_path"]).is_file()
        assert dump["native_traces"] == {victim: failure["native_traceback_path"]}
    elif fault == "SIGKILL":
        assert failure["signal"] == "SIGKILL" and failure["exception"] is None
    else:
        assert failure["stopped_by"] == "SIGTERM" and failure["returncode"] == 0

    # The scheduler's own view, where it could write it: a step raised, or it followed the tokenizer.
    if fault in ("raise", "SIGKILL"):
        [part] = dump["parts"]
        assert stat.S_IMODE(Path(part).stat().st_mode) == 0o600
        assert dump["scheduler_source"] == part
        scheduler = dump["scheduler"]
        assert scheduler["kv_pool"]["total"] > 0 and scheduler["kv_pool"]["used"] > 0
        assert set(scheduler["running_batch"]) == set(pending)  # both requests were decoding
        assert scheduler["waiting_queue"] == [] and scheduler["counters"]["forward_steps"] > 0
        assert all(record["scheduler"]["state"] == "running" and record["scheduler"]["output_tokens"] > 0
                   and record["scheduler"]["first_token_time"] > record["arrival_time"] for record in pending.values())
        assert [r["rid"] for r in dump["recent_requests"]][:4] == ["warmup-0", "warmup-1", "warmup-2", "warmup-3"]
        assert all(r["input_ids"] for r in dump["recent_requests"])
        own = json.loads(Path(part).read_text())
        assert own["writer"] == "scheduler_TP0"
        assert own["actor"] == ("scheduler_TP0" if fault == "raise" else None)  # a follower never blames itself
        text += Path(part).read_text()
    else:
        assert dump["scheduler"] is None and dump["parts"] == [] and dump["recent_requests"] == []
    assert API_KEY not in text and ADMIN_KEY not in text

    # postmortem names the actor; replay re-sends the requests to a fresh server.
    human = _postmortem(str(dump_file))
    assert human.returncode == 0, human.stderr
    assert f"Root cause: app::{victim}" in human.stdout and summary in human.stdout
    [summary_json] = json.loads(_postmortem("--json", str(dump_file)).stdout)
    assert summary_json["actor"] == victim and summary_json["pending_requests"] == 2
    replayed = subprocess.run([sys.executable, str(ROOT / "tools/replay.py"), str(dump_file), "--url", fresh_server,
                               "--speed", "4", "--json"], capture_output=True, text=True, timeout=120)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    *lines, totals = replayed.stdout.strip().splitlines()
    results = [json.loads(line) for line in lines]
    assert {result["rid"] for result in results} == set(pending)
    assert all(result["status"] == 200 for result in results), results
    assert json.loads(totals)["sent"] == 2

    # Nothing left: no actor, no shared-memory name.
    for name, pid in actors.items():
        assert wait_until(lambda: not alive(pid), timeout=5), f"{name} outlived the server"
        reap(pid)
    assert not [entry for entry in os.listdir("/dev/shm") if entry.startswith(f"app-{server.popen.pid}-")]
    leftovers = {p.name for p in dumps.iterdir()} - {dump_file.name, *(Path(p).name for p in dump["parts"]),
                                                      *(Path(p).name for p in dump["native_traces"].values())}
    assert leftovers == set(), "an empty faulthandler file or a temporary was left in the dump folder"
