"""Fixtures for the HTTP tests: the echo backend behind our app, served by hypercorn on a real
local socket (port 0), and clients for it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from echo_backend import EchoBackend

from app.http.asgi import make_app
from app.http.server import serve_http


@pytest.fixture
async def backend(nursery: trio.Nursery) -> EchoBackend:
    echo = EchoBackend()
    await nursery.start(echo.run)
    return echo


@pytest.fixture
def serve(nursery: trio.Nursery) -> Callable[[Any], Awaitable[str]]:
    """Serve an ASGI app for the rest of the test; returns its base URL."""

    async def start(app: Any) -> str:
        binding = await nursery.start(partial(serve_http, app, "127.0.0.1", 0))
        return binding.url

    return start


@pytest.fixture
async def base_url(serve: Callable[[Any], Awaitable[str]], backend: EchoBackend) -> str:
    return await serve(make_app(backend))


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        yield client
