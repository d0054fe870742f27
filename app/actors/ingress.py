"""The ingress: the main process's side of the actors, behind the HTTP layer's Backend interface.

Every request's answers go to the unbounded in-process channel its reader submitted it with
(a slow client never stalls the others); two receive tasks route the tokenizer's rejections
and the detokenizer's text outputs and control replies to their requests. A request whose
reader releases it before its last answer (client disconnect) is aborted upstream. When the
server fails, every open request is answered with a ServerError (the HTTP layer turns it into
a 5xx or an SSE error event), so no client is left waiting.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from app.actors.endpoints import Endpoints
from app.actors.queue_gate import QueueGate
from app.http.backend import Answer, Failure, ModelCard, RequestError, ServerError, ServerState
from app.ipc.trace import RequestTrace
from app.ipc.ring import FrameTooLargeError
from app.ipc.messages import (
    QUEUE_FULL_MESSAGE,
    AbortRequest,
    ControlKind,
    ControlReply,
    ControlRequest,
    GenerateRequest,
    MetricsSnapshot,
    RequestRejected,
    SamplingParams,
    TextBatch,
    TextOutput,
)
from app.observability.ingress_metrics import LatestSnapshots
from app.observability.logs import get_logger
from app.observability.request_log import IngressRequestLog

CONTROL_TIMEOUT_S = 30.0


@dataclass
class _Pending:
    """One submitted request, until its reader releases it: where its answers go, and what a
    crash dump says about it."""

    request: GenerateRequest
    answers: trio.MemorySendChannel[Answer]  # the reader's; closed after the last answer
    started: float = field(default_factory=time.time)
    finished: bool = False  # its last answer was delivered: nothing more to send, nothing to abort
    first_answer: float | None = None  # time.time() of its first answer (a crash dump shows it)


class Ingress:
    """Implements app.http.backend.Backend over the actor channels."""

    def __init__(
        self, endpoints: Endpoints, model: ModelCard, args: dict[str, Any], gate: QueueGate = QueueGate(None),
        request_log: IngressRequestLog | None = None, name: str = "ingress",
    ) -> None:
        self.name = name  # the front's actor name (``ingress_k`` for a worker lane's)
        self.model = model
        self.request_log = request_log  # --log-requests: a request's arrival and finish; None: off
        self.args = args
        self.gate = gate  # refuses arrivals at a certainly full queue without a trip through the actors
        self._to_tokenizer = endpoints.senders["to_tokenizer"]
        self._from_tokenizer = endpoints.receivers["tokenizer_to_ingress"]
        self._from_detokenizer = endpoints.receivers["detokenizer_to_ingress"]
        self._state = ServerState.STARTING
        self.pending: dict[str, _Pending] = {}
        self.unfinished = 0  # requests of ``pending`` whose last answer has not come: the gate's count
        self.refused_at_gate = 0  # arrivals the gate refused (the scheduler's refusals are not counted here)
        self._controls: dict[int, trio.MemorySendChannel[ControlReply]] = {}
        self._control_ids = itertools.count(1)
        self._failure: ServerError | None = None
        self.log = get_logger()
        self.trace = RequestTrace.from_env("ingress")  # also marks the HTTP layer's arrivals
        self.snapshots = LatestSnapshots()  # each actor's latest metrics (--enable-metrics)

    # ------------------------------------------------------------------ lifecycle

    @property
    def state(self) -> ServerState:
        return self._state

    def set_state(self, state: ServerState) -> None:
        self.log.info("server state", state=state.value)
        self._state = state

    @asynccontextmanager
    async def routing(self) -> AsyncIterator[None]:
        """Route the tokenizer's rejections and the detokenizer's outputs and control replies to
        their requests for as long as the block runs (the server's HTTP layer runs inside it)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._route, self._from_tokenizer)
            nursery.start_soon(self._route, self._from_detokenizer)
            try:
                yield
            finally:
                nursery.cancel_scope.cancel()

    async def _route(self, channel: Any) -> None:
        try:
            await self._route_messages(channel)
        except trio.BrokenResourceError as exc:
            # The actor at the other end died; the server answers everyone once the supervisor
            # reports which one.
            self.log.warning("an actor channel broke", channel=channel.name, error=str(exc))

    async def _route_messages(self, channel: Any) -> None:
        async for message in channel:
            if isinstance(message, TextBatch):
                for output in message.outputs:
                    self._deliver(output.rid, output, output.finish is not None)
            elif isinstance(message, RequestRejected):
                error = RequestError(message.message, message.status_code, message.param)
                self._deliver(message.rid, Failure(message.rid, error), True)
            elif isinstance(message, ControlReply):
                waiter = self._controls.pop(message.id, None)
                if waiter is not None:
                    waiter.send_nowait(message)
            elif isinstance(message, MetricsSnapshot):
                self.snapshots.keep(message)

    def _deliver(self, rid: str, answer: Answer, last: bool) -> None:
        """Pass ``answer`` to the request's reader; after its ``last`` one, close its channel."""
        pending = self.pending.get(rid)
        if pending is None or pending.finished:  # its reader is gone (and aborted it), or it is over
            return
        if self.trace.enabled:
            self.trace.mark("ingress.out", rid, int(last))
        if pending.first_answer is None:
            pending.first_answer = time.time()
        if self.request_log is not None:
            self.request_log.delivered(rid, answer, last)
        pending.answers.send_nowait(answer)
        if last:
            pending.finished = True
            self.unfinished -= 1
            pending.answers.close()

    async def warm_up(self) -> None:
        """Short requests through all four actors; the server is healthy only after them. Two
        greedy ones at once, then one greedy and one sampled alone, so that the step paths the
        first clients take (greedy batches of one and of several, sampling) have compiled their
        kernels before any client waits on them."""
        greedy = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0.0)
        sampled = SamplingParams(max_new_tokens=4, ignore_eos=True)
        ids = itertools.count()
        prefix = "warmup" if self.name == "ingress" else f"warmup-{self.name}"  # unique across the lanes

        async def one(params: SamplingParams) -> None:
            await self._generate_to_end(GenerateRequest(f"{prefix}-{next(ids)}", params, text="warm up"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, greedy)
            nursery.start_soon(one, greedy)
        await one(greedy)
        await one(sampled)

    def fail_all(self, error: ServerError) -> None:
        """Answer every request in flight with ``error``; refuse new ones from now on."""
        self._failure = error
        self._state = ServerState.STOPPING
        for rid in self.pending:
            self._deliver(rid, Failure(rid, error), True)
        for waiter in self._controls.values():
            waiter.close()

    # ------------------------------------------------------------------ Backend

    async def submit(self, request: GenerateRequest, answers: trio.MemorySendChannel[Answer]) -> None:
        """Register ``request`` and send it to the tokenizer (Backend.submit). Refused with a 503
        once the server is stopping; while it starts, the HTTP layer refuses clients, and the
        warm-up's own requests go through."""
        if self._failure is not None:
            raise self._failure
        if self._state is ServerState.STOPPING:
            raise RequestError(f"The server is {self._state.value}; try again later.", 503)
        rid = request.rid
        if rid in self.pending:
            raise RequestError(f"duplicate request id {rid!r}", 400, "rid")
        if self.gate.refuses(self.unfinished):
            self.refused_at_gate += 1
            raise RequestError(QUEUE_FULL_MESSAGE, 503)
        self.pending[rid] = _Pending(request, answers)  # before sending: answers may come at once
        self.unfinished += 1
        if self.request_log is not None:
            self.request_log.arrived(request)
        try:
            self.trace.mark("ingress.submit", rid)
            await self._to_tokenizer.send(request)
        except FrameTooLargeError as exc:
            self._forget(rid)  # it never left: nothing to abort
            raise RequestError(f"The request is too large: {exc.args[0].split(': ', 1)[-1]}", 413) from exc
        except (OverflowError, msgspec.EncodeError) as exc:
            # The HTTP schemas bound every number, so only a gap in them lands here; the message
            # is refused whole, before any byte of it reaches the ring.
            self._forget(rid)
            raise RequestError(f"The request holds a value the server cannot carry: {exc}", 400) from exc
        except trio.BrokenResourceError as exc:  # the tokenizer is gone: the server is failing
            await self.release(rid)
            raise self._failure or ServerError("The server failed: the tokenizer stopped taking requests.") from exc
        except BaseException:  # cancelled while sending (the client left)
            await self.release(rid)
            raise

    async def release(self, rid: str) -> None:
        """Forget ``rid``, and abort it upstream unless its last answer was delivered
        (Backend.release); the abort is shielded, for a reader that left has been cancelled."""
        pending = self._forget(rid)
        if pending is not None and not pending.finished:
            with trio.CancelScope(shield=True):  # the reader left: stop the work upstream
                await self._send_abort(rid)

    def _forget(self, rid: str) -> _Pending | None:
        """Drop ``rid`` and close its channel."""
        pending = self.pending.pop(rid, None)
        if self.request_log is not None:
            self.request_log.forgotten(rid)
        if pending is not None:
            if not pending.finished:
                self.unfinished -= 1
            pending.answers.close()
        return pending

    async def _generate_to_end(self, request: GenerateRequest) -> TextOutput:
        """Submit ``request`` and wait for its final output (the warm-up's requests); raises its
        failure instead."""
        send, receive = trio.open_memory_channel[Answer](math.inf)
        await self.submit(request, send)
        try:
            async for answer in receive:
                if isinstance(answer, Failure):
                    raise answer.error
                if answer.finish is not None:
                    return answer
            raise ServerError(f"{request.rid} ended without a final answer")
        finally:
            await self.release(request.rid)

    async def _send_abort(self, rid: str | None, message: str = "the client went away", status: int = 499) -> None:
        try:
            await self._to_tokenizer.send(AbortRequest(rid, message, status))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the server is going down; nothing left to abort

    async def abort(self, rid: str | None) -> bool:
        """Abort ``rid`` (every request when None). A request with several choices (n > 1, or a
        batch of prompts) runs as ``<rid>-0``, ``<rid>-1``, …: its own id aborts all of them."""
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
        return {"args": self.args, "scheduler": scheduler, "requests_in_flight": len(self.pending),
                "queue_gate": {"bound": self.gate.bound, "refused": self.refused_at_gate}}
