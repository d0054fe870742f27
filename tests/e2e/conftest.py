from __future__ import annotations

import pytest

from server import ServerProcess, become_subreaper


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One embedded-model cache for the session (built once, by the first server)."""
    become_subreaper()
    return tmp_path_factory.mktemp("app-cache")


@pytest.fixture
def start_server(cache_dir):
    """``start_server(*flags)``: a serving server; stopped (and every process reaped) after."""
    servers: list[ServerProcess] = []

    def start(*args: str, wait: bool = True, **options) -> ServerProcess:
        server = ServerProcess(*args, cache_dir=cache_dir, **options)
        servers.append(server)
        if wait:
            server.wait_serving()
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """One server for the read-only tests of a module."""
    become_subreaper()
    cache = tmp_path_factory.mktemp("app-cache-shared")
    server = ServerProcess("--context-length", "256", "--max-total-tokens", "4096", cache_dir=cache)
    try:
        server.wait_serving()
        yield server
    finally:
        server.stop()
