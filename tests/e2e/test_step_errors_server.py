"""A step that runs out of device memory in a real server (``APP_FAULT=scheduler:step:oom``: a
``torch.cuda.OutOfMemoryError``, which a CPU build raises as a GPU would): the requests of that
step get a 503 naming it, the server goes on serving, and the event is logged and counted."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server import wait_until

MODEL = "tiny-llama-v1"
OOM_STEP = 120  # in the middle of the streams (the warm-up takes about 15 steps)


def _stream(url: str, events: list[str], started: threading.Event) -> threading.Thread:
    def read() -> None:
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json={
                "model": MODEL, "prompt": "out of memory", "max_tokens": 400, "stream": True,
                "ignore_eos": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _oom_count(url: str) -> float | None:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "app:num_step_errors_total" and sample.labels.get("kind") == "oom":
                return sample.value
    return None


def test_an_out_of_memory_step_fails_its_requests_with_503_and_the_server_goes_on(start_server):
    server = start_server("--enable-metrics", "--context-length", "1024",
                          env={"APP_FAULT": f"scheduler:step:oom:{OOM_STEP}"})
    assert _oom_count(server.url) == 0.0  # the counter is there from the start
    streams = [([], threading.Event()) for _ in range(2)]
    readers = [_stream(server.url, events, started) for events, started in streams]
    for reader in readers:
        reader.join(timeout=30)
    for events, _ in streams:
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "ran out of GPU memory" in error["message"]
        assert "OutOfMemoryError" in error["message"]
        assert len(events) > 2  # it had streamed before the step failed

    # The server goes on: healthy, and a request after the failure is answered whole.
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    after = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "after", "max_tokens": 16, "ignore_eos": True})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 16
    assert wait_until(lambda: _oom_count(server.url) == 1.0, timeout=10, interval=0.1)
    log = server.log()
    assert "a step failed and its requests were ended; serving goes on" in log and "kind=oom" in log
    info = httpx.get(f"{server.url}/server_info", timeout=10).json()["scheduler"]
    assert info["running_requests"] == 0 and info["queued_requests"] == 0

    server.signal(signal.SIGTERM)  # a requested stop, after all that: exit 0
    started = time.monotonic()
    assert server.wait(timeout=30) == 0, server.log()
    assert time.monotonic() - started < 5
