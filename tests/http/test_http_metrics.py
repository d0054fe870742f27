"""The ingress's request metrics and GET /metrics over the HTTP layer: the echo backend behind
MeteredBackend, the app wrapped in CountedHttp, served on a real socket and read with httpx and
prometheus_client's parser. Echo answers one token per output, so every count is known."""

from __future__ import annotations

import json

import httpx
import pytest
from echo_backend import EchoBackend
from prometheus_client.parser import text_string_to_metric_families

from app.http.asgi import make_app
from app.http.auth import ApiKeys, Secret
from app.http.backend import RequestError
from app.http.routes import RouteSettings
from app.ipc.messages import QUEUE_FULL_MESSAGE
from app.observability.http_metrics import CountedHttp, metrics_handler
from app.observability.ingress_metrics import LatestSnapshots, MeteredBackend, ServerMetrics


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def labels(**values: str) -> frozenset[tuple[str, str]]:
    return frozenset({"model_name": "echo", **values}.items())


@pytest.fixture
async def served(serve, backend: EchoBackend):
    """(base URL, the metrics) of an app with priorities on and an API key set."""
    recorder = ServerMetrics("echo", LatestSnapshots(), priority_scheduling=True)
    app = make_app(MeteredBackend(backend, recorder), keys=ApiKeys(api=Secret("sekrit")),
                   settings=RouteSettings(priority_scheduling=True), metrics=metrics_handler(recorder))
    return await serve(CountedHttp(app, app.paths, recorder)), recorder


async def test_requests_tokens_and_latencies_by_priority(served, backend):
    url, _ = served
    auth = {"authorization": "Bearer sekrit"}
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=auth) as client:
        streamed = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "stream": True,
                                                               "priority": 5})
        assert streamed.status_code == 200 and streamed.text.count("data: {") == 3
        whole = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "priority": 1})
        assert whole.json()["choices"][0]["finish_reason"] == "stop"  # the echo ends at the prompt's end
        backend.reject = RequestError(QUEUE_FULL_MESSAGE, 503)
        refused = await client.post("/v1/completions", json={"prompt": "no", "max_tokens": 2})
        assert refused.status_code == 503
        assert (await client.get("/nowhere")).status_code == 404
    async with httpx.AsyncClient(base_url=url, timeout=10) as anonymous:
        response = await anonymous.get("/metrics")  # open: no key needed
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = parse(response.text)
    ttft = "app:time_to_first_token_seconds_count"
    assert samples[(ttft, labels(priority="5"))] == 1 and samples[(ttft, labels(priority="1"))] == 1
    assert samples[("app:inter_token_latency_seconds_count", labels(priority="5"))] == 2  # 3 outputs of 1 token
    assert samples[("app:inter_token_latency_seconds_count", labels(priority="1"))] == 1
    assert samples[("app:e2e_request_latency_seconds_count", labels(priority="5"))] == 1
    assert samples[("app:num_requests_total", labels(priority="5", finish_reason="length"))] == 1
    assert samples[("app:num_requests_total", labels(priority="1", finish_reason="stop"))] == 1
    assert samples[("app:generation_tokens_total", labels())] == 3 + 2
    assert samples[("app:prompt_tokens_total", labels())] == len("hello") + len("hi")
    assert samples[("app:cached_tokens_total", labels())] == 2 * backend.cached_tokens
    assert samples[("app:num_rejected_requests_total", labels(reason="queue_full"))] == 1
    assert samples[("app:num_aborted_requests_total", labels())] == 0
    http = "app:http_requests_total"
    assert samples[(http, labels(route="/v1/completions", status="200"))] == 2
    assert samples[(http, labels(route="/v1/completions", status="503"))] == 1
    assert samples[(http, labels(route="other", status="404"))] == 1
    assert not any(name.endswith("_created") for name, _ in samples)


async def test_an_abort_with_an_error_status_is_a_rejection_and_an_abort(served, backend):
    url, _ = served
    backend.delay_s = 0.2
    backend.abort_status = 503
    auth = {"authorization": "Bearer sekrit"}
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=auth) as client:
        async with client.stream("POST", "/v1/completions",
                                 json={"prompt": "abcdef", "max_tokens": 6, "stream": True}) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    break
            rid = backend.requests[-1].rid
            assert await backend.abort(rid)
            rest = [line async for line in lines]
        assert any('"error"' in line for line in rest), rest
        samples = parse((await client.get("/metrics")).text)
    assert samples[("app:num_rejected_requests_total", labels(reason="unavailable"))] == 1
    assert samples[("app:num_aborted_requests_total", labels())] == 1
    assert ("app:e2e_request_latency_seconds_count", labels(priority="0")) not in samples


async def test_metrics_are_404_when_off(serve, backend):
    url = await serve(make_app(backend))
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        response = await client.get("/metrics")
    assert response.status_code == 404
    assert json.loads(response.text)["message"] == "Metrics are off: start the server with --enable-metrics."
