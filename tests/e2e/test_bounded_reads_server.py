"""Bounded reads through a real server process: clients that trickle their bodies are all cut
(408 at the body deadline, or the 503 of the connection cap) while the server keeps serving, and
the process's open-file limit was raised to fit the cap."""

from __future__ import annotations

import json
import re
import resource
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

import httpx
import pytest

from app.http.server import FILE_RESERVE
from server import wait_until

pytestmark = pytest.mark.slow

MAX_CONNECTIONS = 8
CLIENTS = 20
HEAD = (b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        b"content-length: 100\r\n\r\n")


class Cut(NamedTuple):
    status: int
    body: dict
    after_s: float  # from sending the head to the end of the connection
    ending: str  # "eof": the server closed cleanly; "reset"; "open": still open at the bound


def trickle(host: str, port: int, bound_s: float = 10.0) -> Cut:
    """Send a request head, then its body one byte every 0.2 s, until the server closes."""
    with socket.create_connection((host, port), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(HEAD)
        sock.settimeout(0.2)
        received, ending = b"", "open"
        while time.monotonic() - started < bound_s:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                try:
                    sock.sendall(b" ")
                except OSError:
                    pass  # closed under us: the next recv tells how
                continue
            except ConnectionResetError:
                ending = "reset"
                break
            if not data:
                ending = "eof"
                break
            received += data
        after_s = time.monotonic() - started
    head, _, body = received.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    return Cut(status, json.loads(body) if body else {}, after_s, ending)


def soft_file_limit(pid: int) -> int:
    limits = Path(f"/proc/{pid}/limits").read_text()
    soft = re.search(r"^Max open files\s+(\d+)", limits, re.MULTILINE)
    assert soft is not None, limits
    return int(soft.group(1))


def test_trickling_clients_are_cut_and_the_server_keeps_serving(start_server):
    # Start it under a soft file limit below what the cap needs: the server raises its own.
    inherited = MAX_CONNECTIONS + FILE_RESERVE - 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (inherited, hard))
    try:
        server = start_server("--http-read-timeout", "1", "--max-connections", str(MAX_CONNECTIONS), wait=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    server.wait_serving()
    assert soft_file_limit(server.popen.pid) >= MAX_CONNECTIONS + FILE_RESERVE > inherited

    address = urlsplit(server.url)
    with ThreadPoolExecutor(CLIENTS) as pool:
        cuts = list(pool.map(lambda _: trickle(address.hostname, address.port), range(CLIENTS)))

    statuses = sorted(cut.status for cut in cuts)
    assert statuses == [408] * MAX_CONNECTIONS + [503] * (CLIENTS - MAX_CONNECTIONS), cuts
    for cut in cuts:
        assert cut.ending == "eof", cut
        assert cut.body["code"] == cut.status, cut
        if cut.status == 408:  # served, then cut at the deadline
            assert cut.body["message"] == "The request body did not arrive within 1 s."
            assert 0.9 <= cut.after_s <= 6.0, cut  # generous: a loaded 2-core CI machine
        else:  # refused at once
            assert cut.body["message"] == "Too many open connections; retry shortly."
            assert cut.after_s < 2.0, cut  # at once: no body deadline, generous for a loaded machine

    # The access log has a line for each: the 408s from the app, the 503s from the connection gate
    def access_statuses() -> list[str]:
        return sorted(part for line in list(server.lines) if "logger=access" in line
                      for part in line.split() if part.startswith("status="))
    expected = sorted(["status=408"] * MAX_CONNECTIONS + ["status=503"] * (CLIENTS - MAX_CONNECTIONS))
    assert wait_until(lambda: access_statuses() == expected, timeout=10), access_statuses()

    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/v1/completions", json={"model": "tiny-llama-v1", "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert 1 <= response.json()["usage"]["completion_tokens"] <= 2  # fewer where the model ends it
    assert "Traceback" not in server.log()
