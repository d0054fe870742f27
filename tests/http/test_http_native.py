"""SGLang's native routes with httpx: /generate (whole and streamed), /abort_request, health,
model and server info, /flush_cache."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import trio

from app.http.asgi import make_app
from app.http.backend import ServerError, ServerState
from app.http.routes import RouteSettings
from app.ipc.messages import ControlKind, unpack_tokens


def events(raw: str) -> list[dict]:
    payloads = [line[len("data: "):] for line in raw.split("\n\n") if line]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


async def test_generate_from_text(client, backend):
    sampling = {"max_new_tokens": 3, "temperature": 0}
    response = await client.post("/generate", json={"text": "hello", "sampling_params": sampling})

    body = response.json()
    assert (body["text"], body["output_ids"]) == ("hel", [104, 101, 108])
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (5, 3, 2)
    assert meta["id"] == response.headers["x-request-id"] and meta["e2e_latency"] >= 0
    assert backend.requests[-1].sampling.temperature == 0.0


async def test_generate_defaults_are_sglangs(client, backend):
    await client.post("/generate", json={"text": "x"})

    sampling = backend.requests[-1].sampling
    assert (sampling.max_new_tokens, sampling.temperature, sampling.top_k) == (128, 1.0, -1)


async def test_generate_from_ids_with_stop_reports_what_matched(client, backend):
    by_string = await client.post("/generate", json={"text": "stop here", "sampling_params": {"stop": "here"}})
    by_token = await client.post("/generate", json={"input_ids": [97, 98, 99], "sampling_params": {"stop_token_ids": [98]}})

    assert by_string.json()["text"] == "stop "
    assert by_string.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": "here"}
    assert by_token.json()["text"] == "a" and by_token.json()["output_ids"] == [97, 98]
    assert by_token.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": 98}
    assert unpack_tokens(backend.requests[-1].input_ids) == [97, 98, 99]


async def test_generate_rid_from_the_body(client, backend):
    response = await client.post("/generate", json={"text": "ab", "rid": "mine"}, headers={"x-request-id": "header"})

    assert response.json()["meta_info"]["id"] == "mine" == response.headers["x-request-id"]
    assert backend.requests[-1].rid == "mine"


async def test_generate_stream_carries_the_text_so_far(client):
    response = await client.post("/generate", json={"text": "abc", "stream": True})

    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = events(response.text)
    assert [c["text"] for c in chunks] == ["a", "ab", "abc"]
    assert [c["output_ids"] for c in chunks][-1] == [97, 98, 99]
    assert [c["meta_info"]["finish_reason"] for c in chunks] == [None, None, {"type": "stop", "matched": None}]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 3


async def test_generate_logprobs(client):
    response = await client.post("/generate", json={"text": "ab", "return_logprob": True, "top_logprobs_num": 1})

    meta = response.json()["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 97, None], [-0.5, 98, None]]
    assert meta["output_top_logprobs"] == [[[-0.5, 97, None]], [[-0.5, 98, None]]]


async def test_abort_request_ends_a_running_stream(client, backend):
    backend.delay_s = 0.05
    async with trio.open_nursery() as nursery:
        results: list[httpx.Response] = []

        async def stream() -> None:
            body = {"text": "a long prompt indeed", "stream": True, "rid": "r1"}
            results.append(await client.post("/generate", json=body))

        nursery.start_soon(stream)
        await backend.started.setdefault("r1", trio.Event()).wait()
        aborted = await client.post("/abort_request", json={"rid": "r1"})
        unknown = await client.post("/abort_request", json={"rid": "nobody"})

    assert aborted.json() == {"success": True} and unknown.json() == {"success": False}
    last = events(results[0].text)[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted"}
    assert len(last["text"]) < len("a long prompt indeed")


async def test_health_follows_the_server_state(client, backend):
    serving = await client.get("/health")
    backend.state = ServerState.STARTING
    starting = await client.get("/health")
    generate = await client.post("/generate", json={"text": "x"})
    backend.state = ServerState.STOPPING
    stopping = await client.get("/health")

    assert serving.status_code == 200 and serving.json() == {"status": "serving"}
    assert starting.status_code == stopping.status_code == generate.status_code == 503
    assert "starting" in starting.json()["message"] and "shutting down" in stopping.json()["message"]


async def test_health_generate_runs_one_token(client, backend):
    response = await client.get("/health_generate")

    assert response.status_code == 200
    probe = backend.requests[-1]
    assert probe.sampling.max_new_tokens == 1 and unpack_tokens(probe.input_ids) == [0]


async def test_health_generate_is_503_when_generation_fails(client, backend):
    backend.reject = ServerError("the scheduler died", 500)
    response = await client.get("/health_generate")

    assert response.status_code == 503 and "the scheduler died" in response.json()["message"]


async def test_health_generate_is_503_when_generation_hangs(serve, backend):
    url = await serve(make_app(backend, settings=RouteSettings(health_timeout_s=0.2)))
    backend.delay_s = 30
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.get("/health_generate")

    assert response.status_code == 503 and "did not finish within 0.2 s" in response.json()["message"]
    assert backend.closed_early[backend.requests[-1].rid].is_set()  # the probe was aborted


async def test_model_and_server_info(client):
    model = await client.get("/model_info")
    server = await client.get("/server_info")

    assert model.json() == {
        "model_path": "/models/echo", "served_model_name": "echo", "is_generation": True,
        "context_length": 256, "vocab_size": 0x110000, "architecture": "Echo",
    }
    assert server.json() == {  # no keys configured: every caller sees it all
        "state": "serving",
        "args": {"model_path": "/models/echo", "api_key": None},
        "scheduler": {"running_requests": 0, "queued_requests": 0, "token_usage": 0.0, "max_total_tokens": 4096,
                      "device": "cpu", "step_timing": {"steps": 0}},
        "requests_in_flight": 0,
    }


@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_flush_cache_runs_the_control_command(client, backend, method):
    response = await client.request(method, "/flush_cache")

    assert response.json() == {"success": True, "message": "Cache flushed.", "payload": {"flushed": True}}
    assert backend.controls == [ControlKind.FLUSH_CACHE]


async def test_generate_reports_when_the_tokens_were_produced(client):
    before = time.monotonic()
    streamed = await client.post("/generate", json={"text": "abc", "stream": True})
    whole = await client.post("/generate", json={"text": "abc"})
    after = time.monotonic()

    stamps = [c["meta_info"]["produced_at"] for c in events(streamed.text)]
    assert len(stamps) == 3 and before <= stamps[0] <= stamps[1] <= stamps[2] <= after
    assert stamps[2] <= whole.json()["meta_info"]["produced_at"] <= after
