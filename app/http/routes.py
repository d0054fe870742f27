"""The handlers of every route, and the route table.

Each handler is a few lines: decode the body (which validates it), convert it into
GenerateRequests (the adapters), open the request's stream (request_stream.py: its ``n``
choices submitted and merged; one choice is the same path), answer in one piece (collected)
or as a stream (sse.py), the adapters formatting each output. Errors are raised as
``ApiError`` (or the Backend's own) and rendered by asgi.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from app.http.backend import Backend, ServerState
from app.http.errors import ApiError
from app.http.native_adapter import NativeResponses, generate_request
from app.http.openai_adapter import (
    ChatStream,
    CompletionStream,
    ResponseMeta,
    TokenNamer,
    chat_request,
    chat_response,
    completion_requests,
    completion_response,
    usage_report,
)
from app.http.openapi import openapi_document
from app.http.primitives import Access, JsonResponse, Request, Responder, Route, checked_request_id
from app.http.request_stream import RequestStream
from app.http.schemas import (
    AbortBody,
    AbortResult,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ControlResult,
    GenerateBody,
    GenerateResponse,
    HealthStatus,
    ModelInfo,
    ModelList,
    ModelObject,
)
from app.http.sse import EventStream
from app.ipc.messages import ControlKind, GenerateRequest, SamplingParams, pack_tokens


# GET /metrics's answer (app/observability/http_metrics.py); None: --enable-metrics is off.
MetricsHandler = Callable[[Request], Responder]

# What /server_info shows a caller without the admin key, of the scheduler's figures.
PUBLIC_SCHEDULER_FIGURES = ("running_requests", "queued_requests", "token_usage", "max_total_tokens",
                            "max_running_requests", "context_length")


class RouteSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the handlers need besides the backend; checked once, at start."""

    sampling_defaults: SamplingParams = SamplingParams()  # for fields a client did not send
    health_timeout_s: float = 20.0  # /health_generate answers 503 after this long
    secured: bool = False  # API keys are configured: the OpenAPI document declares the bearer scheme
    priority_scheduling: bool = False  # --enable-priority-scheduling: a request may give a priority
    default_priority: int = 0  # --default-priority-value: the priority of a request that gives none

    def __post_init__(self) -> None:
        if not self.health_timeout_s > 0:
            raise ValueError(f"health_timeout_s must be > 0, got {self.health_timeout_s!r}")
        self.sampling_defaults.validate()

    def priority(self, given: int | None) -> int:
        """A request's priority: its own, or the default. Without --enable-priority-scheduling a
        request that gives one is refused (400), rather than served in an order it did not ask for."""
        if given is None:
            return self.default_priority
        if not self.priority_scheduling:
            raise ApiError.bad_request(
                "`priority` needs priority scheduling: start the server with --enable-priority-scheduling.",
                "priority")
        return given


class Api:
    """The handlers, bound to one backend."""

    def __init__(self, backend: Backend, settings: RouteSettings, token_namer: TokenNamer,
                 metrics: MetricsHandler | None = None) -> None:
        self._backend = backend
        self._metrics = metrics
        self._settings = settings
        self._name = token_namer
        self._created = int(time.time())  # /v1/models reports when we started serving the model
        self._openapi: msgspec.Raw | None = None  # the document, encoded on first use

    def routes(self) -> list[Route]:
        return [
            Route("POST", "/v1/completions", self.completions, "Create a completion (OpenAI).",
                  CompletionRequest, CompletionResponse, CompletionChunk),
            Route("POST", "/v1/chat/completions", self.chat_completions, "Create a chat completion (OpenAI).",
                  ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk),
            Route("GET", "/v1/models", self.models, "List the served model (OpenAI).", None, ModelList),
            Route("POST", "/generate", self.generate, "Generate from text or token ids (SGLang's native API).",
                  GenerateBody, GenerateResponse | list[GenerateResponse], GenerateResponse),
            Route("GET", "/health", self.health, "200 while serving, 503 while starting or stopping.",
                  None, HealthStatus, access=Access.OPEN),
            Route("GET", "/health_generate", self.health_generate, "Generate one token through every actor.",
                  None, HealthStatus),
            Route("GET", "/model_info", self.model_info, "The served model.", None, ModelInfo),
            Route("GET", "/server_info", self.server_info,
                  "Live figures; the server's arguments and the scheduler's details for an admin.",
                  None, dict[str, Any]),
            Route("POST", "/abort_request", self.abort_request, "Abort one request, or all.", AbortBody, AbortResult,
                  access=Access.ADMIN),
            Route("POST", "/flush_cache", self.flush_cache, "Empty the prefix cache.", None, ControlResult,
                  access=Access.ADMIN),
            Route("GET", "/flush_cache", self.flush_cache, "Empty the prefix cache (GET, as SGLang allows).",
                  None, ControlResult, access=Access.ADMIN),
            Route("GET", "/openapi.json", self.openapi, "This document.", None, dict[str, Any]),
            Route("GET", "/metrics", self.metrics, "Prometheus metrics, as text (404 without --enable-metrics).",
                  access=Access.OPEN),
        ]

    # ------------------------------------------------------------ helpers

    def _require_serving(self) -> None:
        state = self._backend.state
        if state is ServerState.STARTING:
            raise ApiError(503, "The server is starting; retry shortly.")
        if state is ServerState.STOPPING:
            raise ApiError(503, "The server is shutting down.")

    def _meta(self, prefix: str, request: Request) -> ResponseMeta:
        return ResponseMeta(f"{prefix}-{request.request_id}", int(time.time()), self._backend.model.name)

    async def _open(self, request: Request, generates: list[GenerateRequest], n: int) -> RequestStream:
        """The stream of ``n`` choices of each request (one per prompt), every choice started;
        closed once the response has been sent (which aborts what has not finished)."""
        self._require_serving()
        if request.traceparent is not None:  # --enable-trace: the actors' spans join the request's trace
            generates = [msgspec.structs.replace(g, traceparent=request.traceparent) for g in generates]
        return await request.resources.enter_async_context(RequestStream(self._backend, generates, n))

    # ------------------------------------------------------------ OpenAI

    async def completions(self, request: Request) -> Responder:
        body = request.json(CompletionRequest)
        model = self._backend.model
        generates = completion_requests(body, request.request_id, model, self._settings.sampling_defaults, time.time(),
                                        priority=self._settings.priority(body.priority))
        stream = await self._open(request, generates, body.n)  # choice p * n + i: prompt p's choice i
        meta, logprobs = self._meta("cmpl", request), body.logprobs is not None
        if body.stream:
            chunks = CompletionStream(meta, stream.choices, usage_report(body.stream_options), logprobs, self._name,
                                      body.n)
            return EventStream(stream, chunks.events)
        return JsonResponse(completion_response(await stream.collect(), meta, logprobs, self._name, body.n))

    async def chat_completions(self, request: Request) -> Responder:
        body = request.json(ChatCompletionRequest)
        model = self._backend.model
        generate = chat_request(body, request.request_id, model, self._settings.sampling_defaults, time.time(),
                                priority=self._settings.priority(body.priority))
        stream = await self._open(request, [generate], body.n)
        meta = self._meta("chatcmpl", request)
        if body.stream:
            chunks = ChatStream(meta, body.n, usage_report(body.stream_options), body.logprobs, self._name)
            return EventStream(stream, chunks.events)
        return JsonResponse(chat_response(await stream.collect(), meta, body.logprobs, self._name))

    async def models(self, request: Request) -> Responder:
        card = self._backend.model
        model = ModelObject(id=card.name, created=self._created, root=card.path, max_model_len=card.context_length)
        return JsonResponse(ModelList(data=[model]))

    # ------------------------------------------------------------ native

    async def generate(self, request: Request) -> Responder:
        body = request.json(GenerateBody)
        if body.rid is not None:  # the body's id wins, so the header answers the same
            request.request_id = checked_request_id(body.rid, "rid")
        arrival = time.time()
        vocab = self._backend.model.vocab_size
        generate = generate_request(body, request.request_id, vocab, self._settings.sampling_defaults, arrival,
                                    priority=self._settings.priority(body.priority))
        n = body.sampling_params.n
        stream = await self._open(request, [generate], n)
        responses = NativeResponses(request.request_id, n, arrival, body.return_logprob)
        if body.stream:
            return EventStream(stream, responses.events)
        async for item in stream:
            responses.add(item)
        return JsonResponse(responses.result())

    async def health(self, request: Request) -> Responder:
        self._require_serving()
        return JsonResponse(HealthStatus(status=self._backend.state.value))

    async def health_generate(self, request: Request) -> Responder:
        """One greedy token from token id 0 (valid in every vocabulary), through every actor."""
        self._require_serving()
        probe = GenerateRequest(
            rid=f"health-{uuid.uuid4().hex}",
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
            input_ids=pack_tokens([0]),
            arrival_time=time.time(),
        )
        with trio.move_on_after(self._settings.health_timeout_s):
            try:
                async with RequestStream(self._backend, [probe]) as stream:
                    await stream.collect()
            except ApiError as exc:
                raise ApiError(503, f"Health generation failed: {exc.message}") from exc
            return JsonResponse(HealthStatus(status="serving"))
        raise ApiError(503, f"Health generation did not finish within {self._settings.health_timeout_s:g} s.")

    async def model_info(self, request: Request) -> Responder:
        card = self._backend.model
        return JsonResponse(
            ModelInfo(
                model_path=card.path,
                served_model_name=card.name,
                context_length=card.context_length,
                vocab_size=card.vocab_size,
                architecture=card.architecture,
            )
        )

    async def server_info(self, request: Request) -> Responder:
        """Everything for an admin; for other callers only the live figures a dashboard shows
        (the arguments hold paths and the whole configuration)."""
        info = await self._backend.server_info()
        if request.admin:
            return JsonResponse({"state": self._backend.state.value, **info})
        scheduler = info.get("scheduler", {})
        return JsonResponse({
            "state": self._backend.state.value,
            "requests_in_flight": info.get("requests_in_flight"),
            "scheduler": {key: scheduler[key] for key in PUBLIC_SCHEDULER_FIGURES if key in scheduler},
        })

    async def abort_request(self, request: Request) -> Responder:
        body = request.json(AbortBody)
        if not body.abort_all and body.rid is None:
            raise ApiError.bad_request("Give `rid`, or `abort_all: true`.", "rid")
        if body.rid is not None:
            checked_request_id(body.rid, "rid")
        found = await self._backend.abort(None if body.abort_all else body.rid)
        return JsonResponse(AbortResult(success=found))

    async def flush_cache(self, request: Request) -> Responder:
        payload = await self._backend.control(ControlKind.FLUSH_CACHE)
        details = msgspec.json.decode(payload) if payload else None
        return JsonResponse(ControlResult(success=True, message="Cache flushed.", payload=details))

    async def metrics(self, request: Request) -> Responder:
        if self._metrics is None:
            raise ApiError(404, "Metrics are off: start the server with --enable-metrics.")
        return self._metrics(request)

    async def openapi(self, request: Request) -> Responder:
        if self._openapi is None:
            document = openapi_document(self.routes(), secured=self._settings.secured)
            self._openapi = msgspec.Raw(msgspec.json.encode(document))
        return JsonResponse(self._openapi)
