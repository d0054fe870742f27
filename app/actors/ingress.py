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
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from app.actors.endpoints import Endpoints
from app.http.backend import ModelCard, RequestError, ServerError, ServerState
from app.ipc.trace import RequestTrace
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
        self.trace = RequestTrace.from_env("ingress")  # also marks the HTTP layer's arrivals

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
            if self.trace.enabled:
                self.trace.mark("ingress.out", rid, int(getattr(item, "finish", None) is not None))
            pending.stream.send_nowait(item)

    async def warm_up(self) -> None:
        """Short requests through all four actors; the server is healthy only after them. Two
        greedy ones at once, then one greedy and one sampled alone, so that the step paths the
        first clients take (greedy batches of one and of several, sampling) have compiled their
        kernels before any client waits on them."""
        greedy = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0.0)
        sampled = SamplingParams(max_new_tokens=4, ignore_eos=True)
        ids = itertools.count()

        async def one(params: SamplingParams) -> None:
            request = GenerateRequest(f"warmup-{next(ids)}", params, text="warm up")
            async for _ in RequestOutputs(self, request, check_state=False):
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, greedy)
            nursery.start_soon(one, greedy)
        await one(greedy)
        await one(sampled)

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

    def generate(self, request: GenerateRequest) -> RequestOutputs:
        return RequestOutputs(self, request, check_state=True)

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


class RequestOutputs:
    """One request's outputs, as ``Ingress.generate`` returns them (an async iterator).

    The first ``__anext__`` submits the request (RequestError for a duplicate rid, a server
    that is not serving, a request too large for the channel); each call then returns the next
    output, and the iterator ends after the final one. A rejection or a server failure is
    raised in its place. Leaving early (``aclose``, or any exception out of ``__anext__``,
    cancellation included) aborts the request upstream, unless its final answer had come.

    ``next_nowait`` returns an output that has already arrived, without waiting (trio.WouldBlock
    when there is none): a reader that fell behind a fast scheduler takes several at once (an
    SSE response then writes them in one piece). A rejection or a failure is never returned
    there: it is kept for ``__anext__``, which raises it.
    """

    def __init__(self, ingress: Ingress, request: GenerateRequest, *, check_state: bool) -> None:
        self._ingress = ingress
        self._request = request
        self._check_state = check_state
        self._receive: trio.MemoryReceiveChannel[Any] | None = None  # set once registered in pending
        self._held: Any = None  # an error item next_nowait took: __anext__ raises it
        self._finished = False  # the final answer came (or the request never left): nothing to abort
        self._started = False
        self._closed = False

    def __aiter__(self) -> RequestOutputs:
        return self

    async def __anext__(self) -> TextOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            if not self._started:
                self._started = True
                await self._submit()
            elif self._finished:
                raise StopAsyncIteration
            assert self._receive is not None
            if self._held is not None:
                item, self._held = self._held, None
            else:
                try:
                    item = await self._receive.receive()
                except trio.EndOfChannel:
                    raise StopAsyncIteration from None
            return self._take(item)
        except BaseException:
            await self.aclose()
            raise

    def next_nowait(self) -> TextOutput:
        """The next output if it has arrived already; trio.WouldBlock otherwise."""
        if self._closed or self._finished or self._receive is None or self._held is not None:
            raise trio.WouldBlock
        item = self._receive.receive_nowait()
        if not isinstance(item, TextOutput):
            self._held = item
            raise trio.WouldBlock
        return self._take(item)

    def _take(self, item: Any) -> TextOutput:
        if isinstance(item, ServerError):
            self._finished = True
            raise item
        if isinstance(item, RequestRejected):
            self._finished = True
            raise RequestError(item.message, item.status_code, item.param)
        self._finished = item.finish is not None
        return item

    async def _submit(self) -> None:
        ingress, request = self._ingress, self._request
        if ingress._failure is not None:
            raise ingress._failure
        if self._check_state and ingress._state is not ServerState.SERVING:
            raise RequestError(f"The server is {ingress._state.value}; try again later.", 503)
        if request.rid in ingress.pending:
            raise RequestError(f"duplicate request id {request.rid!r}", 400, "rid")
        send, receive = trio.open_memory_channel[Any](math.inf)
        ingress.pending[request.rid] = _Pending(request, send)
        self._receive = receive  # registered: aclose undoes it
        ingress._idle = trio.Event() if ingress._idle.is_set() else ingress._idle
        try:
            ingress.trace.mark("ingress.submit", request.rid)
            await ingress._to_tokenizer.send(request)
        except FrameTooLargeError as exc:
            self._finished = True  # it never left: nothing to abort
            raise RequestError(f"The request is too large: {exc.args[0].split(': ', 1)[-1]}", 413) from exc
        except (OverflowError, msgspec.EncodeError) as exc:
            # The HTTP schemas bound every number, so only a gap in them lands here; the message
            # is refused whole, before any byte of it reaches the ring.
            self._finished = True
            raise RequestError(f"The request holds a value the server cannot carry: {exc}", 400) from exc

    async def aclose(self) -> None:
        """Stop reading: forget the request, and abort it upstream unless it has finished."""
        if self._closed:
            return
        self._closed = True
        if self._receive is None:
            return  # never registered: nothing to undo
        ingress, rid = self._ingress, self._request.rid
        del ingress.pending[rid]
        if not ingress.pending:
            ingress._idle.set()
        if not self._finished and ingress._failure is None:
            with trio.CancelScope(shield=True):  # the consumer left: stop the work upstream
                await ingress._send_abort(rid)
