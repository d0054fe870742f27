"""Shutdown and failure through real processes: every client answered, nothing left behind."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server import alive, reap, stream_in_thread, wait_until

LONG = {"max_new_tokens": 4000, "ignore_eos": True}  # the prompt and 4000 fit the context (4096)


def open_stream(url: str, events: list[str], started: threading.Event) -> threading.Thread:
    """Read a long SSE stream in a thread, recording every data line."""
    return stream_in_thread(url, {"model": "tiny-llama-v1", "prompt": "stream", "max_tokens": None, "stream": True,
                                  "ignore_eos": True}, events, started)


def post_in_thread(url: str, results: list[httpx.Response]) -> threading.Thread:
    def post() -> None:
        with httpx.Client(timeout=60) as http:
            results.append(http.post(f"{url}/generate", json={"text": "no stream", "sampling_params": LONG}))

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def assert_all_gone(server, actor_pids: dict[str, int]) -> None:
    for pid in actor_pids.values():
        assert wait_until(lambda: not alive(pid), timeout=5), f"actor {pid} outlived the server"
        reap(pid)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_ends_open_streams_with_an_error_event_and_exits_zero(start_server, sig):
    server = start_server()
    actors = server.actor_pids()
    assert set(actors) == {"tokenizer", "scheduler_TP0", "detokenizer"}
    events: list[str] = []
    started = threading.Event()
    reader = open_stream(server.url, events, started)
    assert started.wait(30)
    server.signal(sig)  # the first drains (tests/e2e/test_drain_server.py): the stream goes on
    assert wait_until(lambda: any("signal received: draining" in line for line in list(server.lines)), timeout=10)
    assert events[-1] != "[DONE]"
    server.signal(sig)
    assert server.wait(timeout=30) == 0, server.log()
    reader.join(timeout=10)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    assert_all_gone(server, actors)


def test_a_signal_during_start_up_stops_the_server_cleanly(start_server):
    server = start_server(wait=False)
    assert wait_until(lambda: any("actor ready" in line for line in list(server.lines)), timeout=120), server.log()
    actors = server.actor_pids()
    assert actors, server.log()
    server.signal(signal.SIGTERM)
    assert server.wait(timeout=30) == 0, server.log()
    assert_all_gone(server, actors)


@pytest.mark.parametrize("victim", ["scheduler_TP0", "tokenizer", "detokenizer"])
def test_an_actor_dying_answers_every_client_writes_a_dump_and_exits_non_zero(start_server, tmp_path, victim):
    dumps = tmp_path / "dumps"
    server = start_server("--crash-dump-folder", str(dumps))
    actors = server.actor_pids()
    events: list[str] = []
    started = threading.Event()
    reader = open_stream(server.url, events, started)
    responses: list[httpx.Response] = []
    poster = post_in_thread(server.url, responses)
    assert started.wait(30)
    time.sleep(0.3)  # let the non-streaming request reach the scheduler
    subprocess.run(["kill", "-KILL", str(actors[victim])], check=True)
    code = server.wait(timeout=30)
    assert code == 1, server.log()
    reader.join(timeout=10)
    poster.join(timeout=10)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert f"app::{victim} was killed by signal SIGKILL" in error["message"]
    assert len(responses) == 1 and responses[0].status_code == 500
    assert "SIGKILL" in responses[0].json()["message"]
    [dump_file] = list(dumps.glob("crash_dump_*.json"))
    dump = json.loads(dump_file.read_text())
    assert dump["actor"] == victim and dump["failure"]["signal"] == "SIGKILL"
    assert len(dump["pending_requests"]) == 2
    assert {p["text"] for p in dump["pending_requests"]} == {"stream", "no stream"}
    assert_all_gone(server, actors)


def test_the_actors_die_within_two_seconds_of_a_sigkilled_ingress(start_server):
    server = start_server()
    actors = server.actor_pids()
    server.signal(signal.SIGKILL)
    server.wait(timeout=10)
    for name, pid in actors.items():
        assert wait_until(lambda: not alive(pid), timeout=2.0), f"{name} outlived the SIGKILLed ingress"
        reap(pid)


def test_an_actor_failing_to_start_is_a_clear_error_with_its_stderr(start_server, cache_dir, tmp_path):
    broken = tmp_path / "broken-model"
    server = start_server()  # makes sure the embedded model exists
    model = Path(server.lines[0].split("path=")[-1]) if "path=" in server.lines[0] else None
    assert model is not None and model.is_dir()
    shutil.copytree(model, broken)
    (broken / "model.safetensors").write_bytes(b"this is not a safetensors file")
    failing = start_server("--model-path", str(broken), wait=False)
    assert failing.wait(timeout=120) == 1
    log = failing.log()
    assert "app::scheduler_TP0 exited with code 1 during start-up" in log
    assert "model.safetensors" in log


def test_bad_arguments_exit_two_with_a_message(cache_dir):
    result = subprocess.run([sys.executable, "-m", "app", "serve", "--max-prefill-tokens", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--max-prefill-tokens must be at least 1" in result.stderr


def test_a_port_in_use_is_a_clear_error_and_nothing_is_left(start_server):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = start_server("--port", str(port), wait=False)
        assert server.wait(timeout=120) == 1
    assert "cannot serve HTTP" in server.log() and "Address already in use" in server.log()
    assert not server.actor_pids()
