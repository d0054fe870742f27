"""What the HTTP layer needs from the rest of the server: one small interface.

The ingress actor implements it (it owns the channels to the tokenizer and from the
detokenizer); the HTTP tests' echo backend implements it too. The HTTP layer never touches the
channels to the actors or the backend's bookkeeping, so that routes, schemas and SSE framing
stay one job, and the ingress stays another.

One request through it (the HTTP side is ``request_stream.RequestStream``)::

    HTTP layer                                    backend
    submit(request, answers) ───────────────────▶ registers the rid, sends the request on
    answers ◀── TextOutput, TextOutput, … ──────  the last one has ``finish`` set
            ◀── Failure ────────────────────────  instead of the rest: rejected, or the server failed
    release(rid) ───────────────────────────────▶ forgets the rid; aborts it unless it had finished
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Protocol

import msgspec
import trio

from app.ipc.messages import ControlKind, GenerateRequest, TextOutput


class ServerState(enum.Enum):
    STARTING = "starting"  # /health answers 503
    SERVING = "serving"  # /health answers 200
    STOPPING = "stopping"  # /health answers 503; new requests get 503


class RequestError(Exception):
    """A request that will not be served: a client error (4xx) or an overload (503).

    ``param`` names the offending field where there is one (OpenAI's error body has it).
    """

    def __init__(self, message: str, status_code: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param


class ServerError(Exception):
    """The server failed while the request was in flight (an actor died, shutdown, ...).

    Delivered as a ``Failure``; the HTTP layer answers 5xx, or ends an open stream with an SSE
    error event and ``data: [DONE]``.
    """

    def __init__(self, message: str, status_code: int = 500, error_type: str = "InternalServerError") -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error_type = error_type


class Failure(NamedTuple):
    """A request's last answer when it gets no final output: an actor rejected it (too long,
    bad template, queue full) or the server failed while it was in flight."""

    rid: str
    error: RequestError | ServerError


# What a request's answers channel carries: outputs, the last with ``finish`` set, or a Failure.
Answer = TextOutput | Failure


class ModelCard(msgspec.Struct, frozen=True):
    """What /v1/models and /model_info report about the served model."""

    name: str  # the id clients put in "model"
    path: str
    context_length: int
    vocab_size: int
    architecture: str


class Backend(Protocol):
    """The serving side of the HTTP layer."""

    model: ModelCard

    @property
    def state(self) -> ServerState: ...

    async def submit(self, request: GenerateRequest, answers: trio.MemorySendChannel[Answer]) -> None:
        """Send ``request`` on its way; its answers arrive on ``answers`` in order, and nothing
        after the last (a TextOutput with ``finish`` set, or a Failure). The backend closes
        ``answers`` after the last answer and on ``release``; several requests may share one
        channel, each with a clone of its own (that is how ``n`` choices are merged).

        Raises RequestError when the request is refused at once (duplicate rid, too large for
        the actor channels, the server stopping) and the ServerError of a failed server: then
        nothing was registered, and ``answers`` is still the caller's.
        """
        ...

    async def release(self, rid: str) -> None:
        """The reader of ``rid`` is done with it (its answer sent, or the client gone): forget
        the request, and abort it upstream unless its last answer was delivered. Called once for
        every request ``submit`` accepted; raises nothing. The caller shields it: a client that
        left has cancelled the reader, and the abort must still go out."""
        ...

    async def abort(self, rid: str | None) -> bool:
        """Abort one request (or all when ``rid`` is None; /abort_request): its reader gets a
        final output with finish ABORT. False if no such request."""
        ...

    async def control(self, kind: ControlKind) -> bytes:
        """Run a control command through the actors; returns the JSON payload of the reply."""
        ...

    async def server_info(self) -> dict:
        """Arguments and live figures (pool, queues) for /server_info, asked for when needed."""
        ...
