"""Keys through a real server, and a faulted run that leaks them nowhere: not in ps, not in the
actors' environment, not in any response, log line or crash dump (which is 0600)."""

from __future__ import annotations

import json
import stat
import subprocess
import threading
from pathlib import Path

import httpx
import openai

from server import alive, reap, wait_until

API_KEY = "sk-test-api-7f3a9c1e"
ADMIN_KEY = "sk-test-admin-2b8d4e6f"
KEYS = (API_KEY, ADMIN_KEY)


def _assert_no_key(text: str, where: str) -> None:
    for key in KEYS:
        assert key not in text, f"a key leaked into {where}"


def _process_texts(pid: int) -> str:
    """What other users may read of a process: its command line (ps), and its environment."""
    texts = []
    for name in ("cmdline", "environ"):
        try:
            texts.append(Path(f"/proc/{pid}/{name}").read_bytes().decode("latin-1"))
        except OSError:
            pass
    return "\n".join(texts)


def test_keys_guard_a_real_server_and_a_fault_leaks_them_nowhere(start_server, tmp_path):
    dumps = tmp_path / "dumps"
    server = start_server("--crash-dump-folder", str(dumps), env={"APP_API_KEY": API_KEY, "APP_ADMIN_API_KEY": ADMIN_KEY})
    actors = server.actor_pids()
    _assert_no_key(_process_texts(server.popen.pid).split("\n")[0], "the server's command line")
    for name, pid in actors.items():
        _assert_no_key(_process_texts(pid), f"{name}'s command line or environment")

    seen: list[str] = []  # every response's status line, headers and body
    def record(response: httpx.Response) -> None:
        response.read()
        seen.append(f"{response.status_code} {dict(response.headers)} {response.text}")

    bearer = {"authorization": f"Bearer {API_KEY}"}
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=server.url, timeout=60, event_hooks={"response": [record]}) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").status_code == 401
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={
            "authorization": "Bearer wrong"}).status_code == 401
        assert http.get("/health_generate").status_code == 401
        assert http.get("/health_generate", headers=bearer).status_code == 200
        assert http.post("/flush_cache", headers=bearer).status_code == 403
        assert http.post("/flush_cache", headers=admin).status_code == 200
        public = http.get("/server_info", headers=bearer).json()
        full = http.get("/server_info", headers=admin).json()
        assert "args" not in public and public["scheduler"]["max_total_tokens"] > 0
        assert full["args"]["api_key"] == full["args"]["admin_api_key"] == "<set>"
        assert full["scheduler"]["device"] == "cpu"
        document = http.get("/openapi.json", headers=bearer).json()
        assert document["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"

    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    completion = sdk.completions.create(model="tiny-llama-v1", prompt="hello", max_tokens=3)
    assert completion.usage.completion_tokens == 3
    try:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError as exc:
        assert exc.status_code == 401 and exc.code == "invalid_api_key"

    # A fault with a request in flight: the scheduler is killed mid-stream.
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{server.url}/v1/completions", headers=bearer, json={
                    "model": "tiny-llama-v1", "prompt": "secret prompt", "max_tokens": None, "stream": True,
                    "ignore_eos": True}) as response:
                for line in response.iter_lines():
                    events.append(line)
                    started.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert started.wait(30)
    subprocess.run(["kill", "-KILL", str(actors["scheduler_TP0"])], check=True)
    assert server.wait(timeout=30) == 1, server.log()
    reader.join(timeout=10)
    assert any("SIGKILL" in event for event in events)

    [dump_file] = list(dumps.glob("crash_dump_*.json"))
    assert stat.S_IMODE(dump_file.stat().st_mode) == 0o600
    dump_text = dump_file.read_text()
    dump = json.loads(dump_text)
    assert "command" not in dump and dump["server_args"]["api_key"] == "<set>"
    assert [p["text"] for p in dump["pending_requests"]] == ["secret prompt"]
    assert list(dumps.iterdir()) == [dump_file]  # no temporary file left beside it
    _assert_no_key(dump_text, "the crash dump")
    _assert_no_key("\n".join(seen + events), "a response")
    _assert_no_key(server.log(), "the log")
    for pid in actors.values():
        assert wait_until(lambda: not alive(pid), timeout=5)
        reap(pid)


def test_a_key_on_the_command_line_works_and_the_log_says_to_prefer_the_environment(start_server):
    server = start_server("--api-key", API_KEY)
    response = httpx.get(f"{server.url}/v1/models", headers={"authorization": f"Bearer {API_KEY}"}, timeout=30)

    assert response.status_code == 200
    warnings = [line for line in server.lines if "visible to every user in ps" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "flags=['--api-key']" in warnings[0]
    for pid in server.actor_pids().values():  # the children never get it, by flag or environment
        _assert_no_key(_process_texts(pid), "an actor")
    _assert_no_key(server.log(), "the log")
