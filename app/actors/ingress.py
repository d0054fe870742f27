"""The ingress: the main process's side of the actors, behind the HTTP layer's Backend interface.

Every request gets an unbounded in-process stream (a slow client never stalls the others);
two receive tasks route the tokenizer's rejections and the detokenizer's text outputs and
control replies to their requests. A request whose consumer goes away (client disconnect)
is aborted upstream. When the server fails, every open request is answered with a
ServerError (the HTTP layer turns it into a 5xx or an SSE error event), so no client is left
waiting.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from app.actors.endpoints import Endpoints
from app.http.backend import ModelCard, RequestError, ServerError, ServerState
from app.ipc.ring import FrameTooLargeError
from app.ipc.messages import (
    AbortRequest,
    ControlKind,
    ControlReply,
    ControlRequest,
    GenerateRequest,
    RequestRejected,
    SamplingParams,
    TextBatch,
    TextOutput,
)
from app.observability.logs import get_logger

CONTROL_TIMEOUT_S = 30.0


@dataclass
class _Pending:
    """One request in flight: its stream, and what a crash dump says about it."""

    request: GenerateRequest
    stream: trio.MemorySendChannel[Any]
    started: float = field(default_factory=time.time)
    tokens: int = 0


class Ingress:
    """Implements app.http.backend.Backend over the actor channels."""

    def __init__(self, endpoints: Endpoints, model: ModelCard, args: dict[str, Any]) -> None:
        self.model = model
        self.args = args
        self._to_tokenizer = endpoints.senders["to_tokenizer"]
        self._from_tokenizer = endpoints.receivers["tokenizer_to_ingress"]
        self._from_detokenizer = endpoints.receivers["detokenizer_to_ingress"]
        self._state = ServerState.STARTING
        self.pending: dict[str, _Pending] = {}
        self._controls: dict[int, trio.MemorySendChannel[ControlReply]] = {}
        self._control_ids = itertools.count(1)
        self._failure: ServerError | None = None
        self._idle = trio.Event()  # set while no request is pending
        self._idle.set()
        self.log = get_logger()

    # ------------------------------------------------------------------ lifecycle

    @property
    def state(self) -> ServerState:
        return self._state

    def set_state(self, state: ServerState) -> None:
        self.log.info("server state", state=state.value)
        self._state = state

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Route messages from the tokenizer and the detokenizer until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._route, self._from_tokenizer)
            nursery.start_soon(self._route, self._from_detokenizer)
            task_status.started()

    async def _route(self, channel: Any) -> None:
        try:
            await self._route_messages(channel)
        except trio.BrokenResourceError as exc:
            # The actor at the other end died; the supervisor reports it and answers everyone.
            self.log.warning("an actor channel broke", channel=channel.name, error=str(exc))

    async def _route_messages(self, channel: Any) -> None:
        async for message in channel:
            if isinstance(message, TextBatch):
                for output in message.outputs:
                    self._deliver(output.rid, output)
            elif isinstance(message, RequestRejected):
                self._deliver(message.rid, message)
            elif isinstance(message, ControlReply):
                waiter = self._controls.pop(message.id, None)
                if waiter is not None:
                    waiter.send_nowait(message)

    def _deliver(self, rid: str, item: Any) -> None:
        pending = self.pending.get(rid)
        if pending is not None:  # else: the client is gone and the request was aborted
            pending.stream.send_nowait(item)

    async def warm_up(self) -> None:
        """One short request through all four actors; the server is healthy only after it."""
        request = GenerateRequest("warmup-0", SamplingParams(max_new_tokens=4, ignore_eos=True), text="warm up")
        async for _ in self._submit(request, check_state=False):
            pass

    def fail_all(self, error: ServerError) -> None:
        """Answer every request in flight with ``error``; refuse new ones from now on."""
        self._failure = error
        self._state = ServerState.STOPPING
        for pending in self.pending.values():
            pending.stream.send_nowait(error)
        for waiter in self._controls.values():
            waiter.close()

    async def wait_idle(self) -> None:
        """Return once no request is pending (each has had its final answer delivered)."""
        await self._idle.wait()

    # ------------------------------------------------------------------ Backend

    def generate(self, request: GenerateRequest) -> AsyncIterator[TextOutput]:
        return self._submit(request, check_state=True)

    async def _submit(self, request: GenerateRequest, *, check_state: bool) -> AsyncIterator[TextOutput]:
        if self._failure is not None:
            raise self._failure
        if check_state and self._state is not ServerState.SERVING:
            raise RequestError(f"The server is {self._state.value}; try again later.", 503)
        if request.rid in self.pending:
            raise RequestError(f"duplicate request id {request.rid!r}", 400, "rid")
        send, receive = trio.open_memory_channel[Any](math.inf)
        pending = _Pending(request, send)
        self.pending[request.rid] = pending
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        finished = False
        try:
            try:
                await self._to_tokenizer.send(request)
            except FrameTooLargeError as exc:
                finished = True  # it never left: nothing to abort
                raise RequestError(
                    f"The request is too large: {exc.args[0].split(': ', 1)[-1]}", 413
                ) from exc
            async for item in receive:
                if isinstance(item, ServerError):
                    finished = True
                    raise item
                if isinstance(item, RequestRejected):
                    finished = True
                    raise RequestError(item.message, item.status_code, item.param)
                finished = item.finish is not None
                yield item
                if finished:
                    return
        finally:
            del self.pending[request.rid]
            if not self.pending:
                self._idle.set()
            if not finished and self._failure is None:
                with trio.CancelScope(shield=True):  # the consumer left: stop the work upstream
                    await self._send_abort(request.rid)

    async def _send_abort(self, rid: str | None, message: str = "the client went away", status: int = 499) -> None:
        try:
            await self._to_tokenizer.send(AbortRequest(rid, message, status))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the server is going down; nothing left to abort

    async def abort(self, rid: str | None) -> bool:
        """Abort ``rid`` (every request when None). A request with n > 1 choices runs as
        ``<rid>-0`` … ``<rid>-<n-1>``: its own id aborts all of them."""
        if rid is None:
            await self._send_abort(None, "aborted by /abort_request", 499)
            return True
        targets = [rid] if rid in self.pending else [r for r in self.pending if r.rsplit("-", 1)[0] == rid]
        for target in targets:
            await self._send_abort(target, "aborted by /abort_request", 499)
        return bool(targets)

    async def control(self, kind: ControlKind) -> bytes:
        if self._failure is not None:
            raise self._failure
        control_id = next(self._control_ids)
        send, receive = trio.open_memory_channel[ControlReply](1)
        self._controls[control_id] = send
        try:
            await self._to_tokenizer.send(ControlRequest(control_id, kind))
            with trio.move_on_after(CONTROL_TIMEOUT_S):
                try:
                    reply = await receive.receive()
                except trio.EndOfChannel:
                    raise self._failure or ServerError("the server is shutting down", 503) from None
                if not reply.ok:
                    raise RequestError(reply.error or f"{kind.value} failed", 400)
                return reply.payload
            raise ServerError(f"no reply to {kind.value} within {CONTROL_TIMEOUT_S:.0f} s", 503)
        finally:
            self._controls.pop(control_id, None)

    async def server_info(self) -> dict[str, Any]:
        """Arguments, and the scheduler's figures of this moment (asked for through the actors,
        behind the requests already sent); without them while the server is not serving."""
        scheduler: dict[str, Any] = {}
        if self._state is ServerState.SERVING:
            try:
                scheduler = json.loads(await self.control(ControlKind.SERVER_INFO))
            except (ServerError, RequestError) as exc:
                scheduler = {"error": str(exc)}
        return {"args": self.args, "scheduler": scheduler, "requests_in_flight": len(self.pending)}

    def pending_summary(self) -> list[dict[str, Any]]:
        """What a crash dump records about each request in flight."""
        return [
            {
                "rid": rid,
                "started": p.started,
                "stream": p.request.stream,
                "text": (p.request.text or "")[:2048],
                "input_ids_bytes": len(p.request.input_ids or b""),
                "messages": len(p.request.messages or ()),
                "sampling": msgspec.to_builtins(p.request.sampling),
            }
            for rid, p in self.pending.items()
        ]
