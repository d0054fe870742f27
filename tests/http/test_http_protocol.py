"""HTTP behaviour every route shares, over a real socket with httpx: validation errors, routing
errors, body limits, SSE framing, failures before and during a stream, client disconnects,
request ids, the API key, the OpenAPI document, lifespan and graceful shutdown."""

from __future__ import annotations

import json
from functools import partial

import httpx
import msgspec
import pytest
import trio
from echo_backend import EchoBackend

from app.http.asgi import make_app
from app.http.backend import RequestError, ServerError
from app.http.errors import ApiError
from app.http.routes import RouteSettings
from app.http.server import serve_http


def sse_payloads(raw: str) -> list[str]:
    """The data of each event; asserts the framing is exactly `data: ...\\n\\n` per event."""
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("/v1/completions", b"{bad", None, "Invalid JSON"),
        ("/v1/completions", b"", None, "Invalid JSON"),
        ("/v1/completions", {}, "prompt", "missing required field `prompt`"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens", "Expected `int | null`, got `str`"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens", ">= 0"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", "top_p must be a float > 0.0"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens", "min_tokens must be <="),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "logprobs must be an int <= 20"),
        ("/v1/completions", {"prompt": "x", "n": 17}, "n", "n must be an int <= 16"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "n": 0}, "n", "n must be an int >= 1"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo", "`echo` is not supported"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"one": 2.0}}, "logit_bias",
         "a key of logit_bias: Expected `str` matching regex '^[0-9]{1,10}$'"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias[...]", "logit_bias[...] must be a float <= 100.0"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "logit_bias": {"99999999": 1}}, "logit_bias",
         "outside the vocabulary"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"1": "up"}}, "logit_bias[...]", "Expected `float`"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt[1]", "prompt[1] must be a str of length >= 1"),
        ("/v1/completions", {"prompt": [[1], []]}, "prompt[1]", "prompt[1] must be an array of length >= 1"),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of", "best_of must be an int <= 1"),
        ("/v1/completions", {"prompt": [[5], [6, -1]]}, "prompt[1][1]", "prompt[1][1] must be an int >= 0"),
        ("/v1/completions", {"prompt": ["a"] * 257}, "prompt", "at most 256 a request"),
        ("/v1/completions", {"prompt": ""}, "prompt", "prompt must be a str of length >= 1"),
        ("/v1/completions", {"prompt": []}, "prompt", "prompt must be an array of length >= 1"),
        ("/v1/completions", {"prompt": [1, [2]]}, "prompt", "prompt must be a string"),
        ("/v1/completions", {"prompt": [5, -1, -2]}, "prompt[1]", "prompt[1] must be an int >= 0"),
        ("/v1/completions", {"prompt": [5, 2**31 - 1, 2]}, "prompt", "token id 2147483647, outside the vocabulary"),
        ("/v1/completions", {"prompt": [5, 2**40, -1]}, "prompt[1]", "prompt[1] must be an int <= 2147483647"),
        ("/v1/completions", {"prompt": [[7, 2**31]]}, "prompt[0][1]", "prompt[0][1] must be an int <= 2147483647"),
        ("/v1/completions", {"prompt": [[7, 2**31 - 1]]}, "prompt", "token id 2147483647, outside"),
        ("/v1/completions", {"prompt": "x", "stop": ["a", ""]}, "stop[1]", "stop[1] must be a str of length >= 1"),
        ("/v1/chat/completions", {"messages": []}, "messages", "messages must be an array of length >= 1"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text", "messages[0].content[0].text must be a string."),
        ("/v1/chat/completions", {"messages": [{"role": "robot"}]}, "messages[0].role", "Invalid enum value 'robot'"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role", "missing required field"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
            "only text content parts",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "tools": [{}]}, "tools", "not supported"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}], "response_format": {"type": "json_object"}},
            "response_format.type",
            "Invalid enum value 'json_object'",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}], "max_completion_tokens": -5},
            "max_completion_tokens",
            ">= 0",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ("/generate", {}, "text", "exactly one of `text` and `input_ids`"),
        ("/generate", {"text": "x", "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens", "unknown field"),
        ("/generate", {"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature", "sampling_params.temperature must be a float >= 0.0"),
        ("/generate", {"input_ids": [-1]}, "input_ids[0]", "input_ids[0] must be an int >= 0"),
        ("/generate", {"input_ids": [2**31 - 1]}, "input_ids", "outside the vocabulary"),
        ("/generate", {"text": "x", "sampling_params": {"logit_bias": {"a": 1}}}, "sampling_params.logit_bias",
         "a key of sampling_params.logit_bias: Expected `str` matching regex"),
        ("/generate", {"text": "x", "sampling_params": {"logit_bias": {"1": -200}}}, "sampling_params.logit_bias[...]",
         "must be a float >= -100.0"),
        ("/generate", {"text": "x", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num", "top_logprobs_num must be an int <= 20"),
        ("/abort_request", {}, "rid", "Give `rid`"),
    ],
)
async def test_bad_requests_get_400_naming_the_field(client, backend, path, body, param, fragment):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await client.post(path, content=content, headers={"content-type": "application/json"})

    assert response.status_code == 400
    error = response.json()
    assert error["object"] == "error" and error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param
    assert fragment in error["message"]
    assert backend.requests == []  # nothing reached the backend


async def test_unknown_route_is_404_and_wrong_method_is_405(client):
    missing = await client.get("/v2/nothing")
    wrong = await client.get("/v1/chat/completions")

    assert missing.status_code == 404
    assert missing.json() == {
        "object": "error", "message": "There is no route /v2/nothing.", "type": "NotFoundError", "param": None, "code": 404,
    }
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["type"] == "MethodNotAllowedError" and wrong.json()["code"] == 405


async def test_body_over_the_limit_is_413(serve, backend):
    url = await serve(make_app(backend, max_body_bytes=1024))
    big = json.dumps({"prompt": "x" * 2048}).encode()

    async with httpx.AsyncClient(base_url=url) as client:
        declared = await client.post("/v1/completions", content=big)

        async def chunks():  # no Content-Length: the limit applies while reading
            for i in range(0, len(big), 256):
                yield big[i : i + 256]

        streamed = await client.post("/v1/completions", content=chunks())
        after = await client.post("/v1/completions", json={"prompt": "still serving"})

    assert declared.status_code == streamed.status_code == 413
    assert declared.json()["type"] == "PayloadTooLargeError" and "1024 bytes" in declared.json()["message"]
    assert after.status_code == 200


async def test_sse_framing_and_headers(client):
    response = await client.post("/v1/completions", json={"prompt": "abc", "stream": True})

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "b", "c"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage


async def test_server_error_mid_stream_sends_an_error_event_then_done(client, backend):
    backend.fail_after = 2
    body = {"messages": [{"role": "user", "content": "abcdef"}], "stream": True}
    response = await client.post("/v1/chat/completions", json=body)

    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    error = {"message": "the scheduler died", "type": "InternalServerError", "code": 500}
    assert json.loads(payloads[-2]) == {"error": error}
    contents = [json.loads(p)["choices"][0]["delta"].get("content") for p in payloads[:-2]]
    assert contents == ["", "a", "b"]


@pytest.mark.parametrize("stream", [False, True])
async def test_failure_before_the_first_output_is_a_json_error(client, backend, stream):
    backend.reject = ServerError("the tokenizer is gone", 503, "ServiceUnavailableError")
    response = await client.post("/v1/completions", json={"prompt": "abc", "stream": stream})

    assert response.status_code == 503
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {
        "object": "error", "message": "the tokenizer is gone", "type": "ServiceUnavailableError", "param": None, "code": 503,
    }


@pytest.mark.parametrize(("status", "kind"), [(400, "BadRequestError"), (503, "ServiceUnavailableError")])
async def test_rejected_request_keeps_its_status_and_param(client, backend, status, kind):
    message = "The input (300 tokens) is longer than the model's context length (256 tokens)."
    backend.reject = RequestError(message, status, "prompt")
    response = await client.post("/v1/completions", json={"prompt": "abc", "stream": True})

    assert response.status_code == status
    assert response.json()["type"] == kind and response.json()["param"] == "prompt"
    assert "300 tokens" in response.json()["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_abort_with_an_error_status_is_an_error(client, backend, stream):
    backend.delay_s = 0.05
    backend.abort_status = 503
    results = []
    async with trio.open_nursery() as nursery:
        body = {"prompt": "slow prompt", "stream": stream}
        post = partial(client.post, "/v1/completions", json=body, headers={"x-request-id": "evicted"})

        async def run() -> None:
            results.append(await post())

        nursery.start_soon(run)
        await backend.started.setdefault("evicted", trio.Event()).wait()
        await trio.sleep(0.06)  # past the first output, so a stream has started
        assert await backend.abort("evicted")

    [response] = results
    if stream:
        error = json.loads(response.text.split("\n\n")[-3][len("data: "):])
        assert error == {"error": {"message": "aborted", "type": "ServiceUnavailableError", "code": 503}}
    else:
        assert response.status_code == 503 and response.json()["message"] == "aborted"


async def test_client_leaving_a_stream_aborts_the_request(client, backend):
    backend.delay_s = 0.05
    body = {"prompt": "a long prompt that takes a while", "stream": True}
    async with client.stream("POST", "/v1/completions", json=body, headers={"x-request-id": "leaver"}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up

    with trio.fail_after(2):
        await backend.closed_early["leaver"].wait()


async def test_client_leaving_a_plain_request_aborts_it(client, backend):
    backend.delay_s = 30  # the answer would take minutes
    async with trio.open_nursery() as nursery:
        headers = {"x-request-id": "impatient"}
        nursery.start_soon(partial(client.post, "/v1/completions", json={"prompt": "abc"}, headers=headers))
        with trio.fail_after(2):
            await backend.started.setdefault("impatient", trio.Event()).wait()
        nursery.cancel_scope.cancel()  # the client gives up: httpx closes its connection

    with trio.fail_after(2):
        await backend.closed_early["impatient"].wait()


async def test_request_id_comes_from_the_header_and_is_answered(client, backend):
    given = await client.post("/v1/completions", json={"prompt": "ab"}, headers={"X-Request-Id": "req-42"})
    fresh = await client.post("/v1/completions", json={"prompt": "ab"})

    assert given.headers["x-request-id"] == "req-42" and given.json()["id"] == "cmpl-req-42"
    assert backend.requests[0].rid == "req-42"
    assert fresh.headers["x-request-id"] == backend.requests[1].rid and len(backend.requests[1].rid) == 32
    assert fresh.json()["id"] == f"cmpl-{backend.requests[1].rid}"


async def test_openapi_document_lists_the_routes_and_resolves(client):
    response = await client.get("/openapi.json")

    doc = response.json()
    assert doc["openapi"] == "3.1.0"
    methods = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert {
        ("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"), ("/generate", "post"),
        ("/health", "get"), ("/health_generate", "get"), ("/model_info", "get"), ("/server_info", "get"),
        ("/abort_request", "post"), ("/flush_cache", "post"), ("/openapi.json", "get"),
    } <= methods
    schemas = doc["components"]["schemas"]
    refs = {m.split("/")[-1] for m in _refs(doc)}
    assert refs <= set(schemas) and {"CompletionRequest", "ChatCompletionRequest", "GenerateBody", "ErrorBody"} <= refs
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    request_schema = chat["requestBody"]["content"]["application/json"]["schema"]
    assert request_schema == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert schemas["CompletionRequest"]["properties"]["n"]["maximum"] == 16
    assert "time.monotonic()" in schemas["MetaInfo"]["properties"]["produced_at"]["description"]


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


async def test_lifespan_startup_and_shutdown_complete(backend):
    app = make_app(backend)
    to_app, app_receives = trio.open_memory_channel(2)
    app_sends, from_app = trio.open_memory_channel(2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, {"type": "lifespan"}, app_receives.receive, app_sends.send)
        await to_app.send({"type": "lifespan.startup"})
        assert await from_app.receive() == {"type": "lifespan.startup.complete"}
        await to_app.send({"type": "lifespan.shutdown"})
        assert await from_app.receive() == {"type": "lifespan.shutdown.complete"}


async def test_graceful_shutdown_finishes_in_flight_requests_then_returns(backend):
    backend.delay_s = 0.05
    shutdown = trio.Event()
    statuses: list[int] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            binding = await nursery.start(partial(serve_http, make_app(backend), "127.0.0.1", 0, shutdown=shutdown))

            async def request() -> None:
                async with httpx.AsyncClient(base_url=binding.url) as client:
                    headers = {"x-request-id": "late"}
                    response = await client.post("/v1/completions", json={"prompt": "abcd"}, headers=headers)
                    statuses.append(response.status_code)

            nursery.start_soon(request)
            await backend.started.setdefault("late", trio.Event()).wait()
            shutdown.set()  # serve_http returns once the request has been answered

    assert statuses == [200]
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=binding.url) as client:
            await client.get("/health")


def test_settings_are_validated_at_start():
    with pytest.raises(ValueError, match="health_timeout_s"):
        RouteSettings(health_timeout_s=0)
    with pytest.raises(ValueError, match="max_body_bytes"):
        make_app(EchoBackend(), max_body_bytes=0)


def test_errors_encode_as_documented():
    assert msgspec.json.decode(msgspec.json.encode(ApiError(404, "gone").body())) == {
        "object": "error", "message": "gone", "type": "NotFoundError", "param": None, "code": 404,
    }
