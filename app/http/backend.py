"""What the HTTP layer needs from the rest of the server: one small interface.

The ingress actor implements it (it owns the channels to the tokenizer and from the
detokenizer). The HTTP layer never touches channels or actors directly, so that routes,
schemas and SSE framing stay one job, and the ingress stays another.
"""

from __future__ import annotations

import enum
from typing import AsyncIterator, Protocol

import msgspec

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

    Raised from ``generate``'s iterator; the HTTP layer answers 5xx, or ends an open stream
    with an SSE error event and ``data: [DONE]``.
    """

    def __init__(self, message: str, status_code: int = 500, error_type: str = "InternalServerError") -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error_type = error_type


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

    def generate(self, request: GenerateRequest) -> AsyncIterator[TextOutput]:
        """Submit a request and iterate over its outputs; the last one has ``finish`` set.

        Raises RequestError before the first output for a rejected request (too long,
        duplicate rid, queue full, bad template), ServerError when the server fails.
        Closing the iterator early (client gone) aborts the request.

        The iterator may also have ``next_nowait()``: the next output if it has arrived
        already, else ``trio.WouldBlock`` (errors are left for ``__anext__`` to raise). A
        streamed response that fell behind uses it to write every output it has in one piece.
        """
        ...

    async def abort(self, rid: str | None) -> bool:
        """Abort one request (or all when ``rid`` is None); False if no such request."""
        ...

    async def control(self, kind: ControlKind) -> bytes:
        """Run a control command through the actors; returns the JSON payload of the reply."""
        ...

    async def server_info(self) -> dict:
        """Arguments and live figures (pool, queues) for /server_info, asked for when needed."""
        ...
