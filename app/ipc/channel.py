"""trio channels over a shared-memory ring, with the contract of trio's memory channels.

``open_sender(spec)`` and ``open_receiver(spec, MessageType)`` attach one half each, in the
same process or in two. The halves behave like ``trio.open_memory_channel``'s:

- ``await send(msg)`` waits while the ring is full (backpressure); ``await receive()`` waits
  while it is empty; both are trio checkpoints and both are cancellation-safe: a frame is
  written or consumed in one synchronous step after the wait, never across an ``await``.
- ``close()``/``aclose()``; a receiver whose sender closed gets the remaining messages, then
  ``trio.EndOfChannel``; a sender whose receiver closed gets ``trio.BrokenResourceError``;
  using a half after closing it raises ``trio.ClosedResourceError``.
- ``statistics()`` with trio's field names (buffer figures in bytes).
- Many tasks of one process may send (or receive) on one half: a ``trio.Lock`` serialises
  them, so the ring itself stays single-producer / single-consumer.

Extra, because the other end is a process that can die: a half notices when the process
at the other end is gone (through a pidfd) and raises :class:`PeerDiedError`, a
``BrokenResourceError``, instead of waiting forever. Messages the peer fully wrote before
dying are still delivered first.

Wake-ups: the sender writes ``data_fd`` on every empty → non-empty transition, the receiver
writes ``space_fd`` when a sleeping sender's room has appeared. Each half waits with
``trio.lowlevel.wait_readable`` on one epoll descriptor that holds its eventfd and the peer's
pidfd, so it burns no CPU and never blocks the trio loop. With no memory fence in Python,
the two sides can each miss the other's latest index store (store→load reordering), so a
wake-up can be lost; a short backstop timeout bounds the cost of that rare case.
"""

from __future__ import annotations

import os
import select
import time
from typing import Any, Callable, Generic, NamedTuple, TypeVar

import msgspec
import trio

from app.ipc.ring import CorruptFrameError, RingError
from app.ipc.segment import ChannelSpec, map_ring

T = TypeVar("T")

# Longest sleep between re-checks of the ring, in case a wake-up was lost: short right after
# activity (where a lost wake-up can happen), doubling while idle (where it cannot, but for the
# microseconds of each re-check). The ceiling sets an idle half's wake-ups: on the 2-core VM one
# costs ~7 ms of CPU (a bare trio loop waking once a second uses 0.7 % of a core), so at 1 s the
# ingress's two receivers idled at 1.4-1.7 % of a core; at 4 s, 0.6 %.
BACKSTOP_MIN_SECONDS = 0.005
BACKSTOP_MAX_SECONDS = 4.0
SPIN_SECONDS = 100e-6  # cooperative polling before sleeping on the eventfd
# trio's channels yield to the scheduler on every operation. A full scheduler pass costs
# more than a whole frame copy, so a half whose ring keeps being ready yields only this often
# (shielded: the operation has already happened); other tasks still run.
FAIRNESS_SECONDS = 200e-6


_EMPTY = object()  # what _try_receive returns for an empty ring (None can be a message)


class PeerDiedError(trio.BrokenResourceError):
    """The process at the other end of the channel is gone without closing its half."""


class ChannelDecodeError(RingError):
    """A frame arrived whole but does not decode as this channel's message type."""


class ChannelStatistics(NamedTuple):
    """trio's MemoryChannelStatistics fields (buffer in bytes) plus the channel's name."""

    name: str
    current_buffer_used: int
    max_buffer_size: int
    open_send_channels: int
    open_receive_channels: int
    tasks_waiting_send: int
    tasks_waiting_receive: int


class _Endpoint:
    """What both halves share: the mapping, the wake-up descriptors and the peer watch."""

    def __init__(self, spec: ChannelSpec, *, is_sender: bool) -> None:
        self.name = spec.name
        self._buffer, self.ring = map_ring(spec)
        self._is_sender = is_sender
        # Our own copies of the eventfds: the spec's descriptors may serve the other half
        # in this same process, and each half closes only what it owns.
        self._wake_fd = os.dup(spec.space_fd if is_sender else spec.data_fd)
        self._notify_fd = os.dup(spec.data_fd if is_sender else spec.space_fd)
        self._epoll = select.epoll()
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        self._peer_pid = 0
        self._peer_fd: int | None = None
        self._closed = False
        self._lock = trio.Lock()
        self._waiting = 0
        self._last_yield = 0.0  # perf_counter() of this half's last pass through the scheduler
        if is_sender:
            self.ring.mark_sender(os.getpid())
        else:
            self.ring.mark_receiver(os.getpid())
        self._watch_peer()

    # ------------------------------------------------------------ peer watch

    def _watch_peer(self) -> None:
        """Open a pidfd for the peer once it has attached (its pid appears in the header)."""
        if self._peer_fd is not None:
            return
        pid = self.ring.receiver_pid if self._is_sender else self.ring.sender_pid
        if pid == 0:
            return
        try:
            self._peer_fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._peer_fd = -1  # already gone before we could watch it
        else:
            self._epoll.register(self._peer_fd, select.EPOLLIN)
        self._peer_pid = pid

    def _peer_gone(self) -> bool:
        self._watch_peer()
        if self._peer_fd is None:
            return False
        if self._peer_fd < 0:
            return True
        readable, _, _ = select.select([self._peer_fd], [], [], 0)
        return bool(readable)

    def _peer_died_error(self) -> PeerDiedError:
        role = "receiving" if self._is_sender else "sending"
        return PeerDiedError(f"channel {self.name!r}: the {role} process (pid {self._peer_pid}) died")

    # ------------------------------------------------------------ waiting

    async def _sleep(self, ready: Callable[[], bool], attempt: int) -> None:
        """Wait until ``ready()`` may have become true; ``attempt`` counts the caller's
        consecutive waits within one operation.

        On the first attempt, a short cooperative spin: re-check ``ready()`` once per trio
        scheduler pass (other tasks keep running) for up to SPIN_SECONDS, since a peer in
        the middle of a request/reply exchange usually answers within that and waking
        through an eventfd costs tens of microseconds. Then sleep on the eventfd, the
        peer's death, or the backstop timeout, burning no CPU.
        """
        self._waiting += 1
        self._last_yield = time.perf_counter()
        try:
            if attempt == 0:
                deadline = self._last_yield + SPIN_SECONDS
                while time.perf_counter() < deadline:
                    await trio.lowlevel.checkpoint()
                    os.sched_yield()  # on a busy machine the peer may share our core
                    if ready():
                        return
            backstop = min(BACKSTOP_MIN_SECONDS * 2 ** min(attempt, 16), BACKSTOP_MAX_SECONDS)
            with trio.move_on_after(backstop):
                await trio.lowlevel.wait_readable(self._epoll.fileno())
        finally:
            self._waiting -= 1
        try:
            os.eventfd_read(self._wake_fd)
        except BlockingIOError:
            pass

    def _notify(self) -> None:
        os.eventfd_write(self._notify_fd, 1)

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError(f"channel {self.name!r}: this half is closed")

    # ------------------------------------------------------------ closing

    def _release(self) -> None:
        """Wake local waiters, then drop views, mapping and descriptors (in that order)."""
        self._closed = True
        try:
            trio.lowlevel.notify_closing(self._epoll.fileno())
        except RuntimeError:
            pass  # closed outside trio: no task of ours can be waiting
        self._epoll.close()
        for fd in (self._wake_fd, self._notify_fd, self._peer_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.ring.release()  # mmap.close() raises BufferError while views live
        self._buffer.close()

    def _statistics(self) -> ChannelStatistics:
        ring = self.ring
        if self._closed:
            return ChannelStatistics(self.name, 0, 0, 0, 0, 0, 0)
        sender_open = int(not ring.sender_closed)
        receiver_open = int(not ring.receiver_closed)
        return ChannelStatistics(
            name=self.name,
            current_buffer_used=ring.used(),
            max_buffer_size=ring.capacity,
            open_send_channels=sender_open,
            open_receive_channels=receiver_open,
            tasks_waiting_send=(self._waiting + self._lock.statistics().tasks_waiting) if self._is_sender else 0,
            tasks_waiting_receive=0 if self._is_sender else self._waiting + self._lock.statistics().tasks_waiting,
        )

    def __enter__(self):  # noqa: ANN204 - returns the concrete half
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        """Close, as trio's AsyncResource does: idempotent, and a checkpoint."""
        self.close()
        await trio.lowlevel.checkpoint()

    def statistics(self) -> ChannelStatistics:
        return self._statistics()


class ShmSendChannel(_Endpoint, Generic[T]):
    """The sending half. Raises FrameTooLargeError (before waiting) for a message that
    can never fit, BrokenResourceError once the receiver closed, PeerDiedError when the
    receiving process is gone, ClosedResourceError after ``close()``."""

    def __init__(self, spec: ChannelSpec) -> None:
        super().__init__(spec, is_sender=True)
        self._encoder = msgspec.msgpack.Encoder()
        self._scratch = bytearray()
        self.messages_sent = 0

    @property
    def max_message_bytes(self) -> int:
        """The largest encoded message this channel carries (its ring's largest frame)."""
        return self.ring.max_frame

    def _encode(self, message: T) -> bytearray:
        self._encoder.encode_into(message, self._scratch)
        return self._scratch

    def send_nowait(self, message: T) -> None:
        """Send without waiting; raises trio.WouldBlock when the ring is full."""
        self._check_open()
        if self._lock.locked():
            raise trio.WouldBlock
        if not self._try_send(self._encode(message)):
            raise trio.WouldBlock

    def _try_send(self, payload: bytearray) -> bool:
        ring = self.ring
        if ring.receiver_closed:
            raise trio.BrokenResourceError(f"channel {self.name!r}: the receiver closed its half")
        was_empty = ring.try_write(payload)
        if was_empty is None:
            return False
        if was_empty:
            self._notify()
        self.messages_sent += 1
        return True

    async def send(self, message: T) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        if not self._lock.locked() and self._try_send(self._encode(message)):
            # Done without waiting; yield to the scheduler only every FAIRNESS_SECONDS.
            now = time.perf_counter()
            if now - self._last_yield >= FAIRNESS_SECONDS:
                self._last_yield = now
                await trio.lowlevel.cancel_shielded_checkpoint()
            return
        async with self._lock:
            self._check_open()
            payload = self._encode(message)
            need = self.ring.frame_bytes(len(payload))
            attempt = 0
            while not self._try_send(payload):
                if self._peer_gone():
                    raise self._peer_died_error()
                self.ring.want_space(need)
                try:
                    if self._try_send(payload):  # room appeared before the receiver saw our wish
                        return
                    await self._sleep(lambda: self.ring.capacity - self.ring.used() >= need, attempt)
                    attempt += 1
                    self._check_open()
                finally:
                    if not self._closed:
                        self.ring.want_space(0)

    def close(self) -> None:
        """Close the sending half: the receiver gets what was sent, then EndOfChannel."""
        if self._closed:
            return
        self.ring.close_sender()
        self._notify()
        self._release()


class ShmReceiveChannel(_Endpoint, Generic[T]):
    """The receiving half. Raises EndOfChannel once the sender closed and the ring is
    drained, PeerDiedError once the sending process is gone and the ring is drained,
    ChannelDecodeError/CorruptFrameError on a bad frame (the channel stays usable),
    ClosedResourceError after ``close()``."""

    def __init__(self, spec: ChannelSpec, message_type: Any) -> None:
        super().__init__(spec, is_sender=False)
        self._decode = msgspec.msgpack.Decoder(message_type).decode
        self.messages_received = 0

    def _try_receive(self) -> Any:
        """The next message (the frame is consumed), or _EMPTY when the ring is empty."""
        try:
            got = self.ring.read_with(self._decode)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._notify()  # the frame was consumed: a sleeping sender may have its room now
            raise ChannelDecodeError(f"channel {self.name!r}: undecodable message: {exc}") from exc
        if got is None:
            return _EMPTY
        message, wake_sender = got
        if wake_sender:
            self._notify()
        self.messages_received += 1
        return message

    def _has_data(self) -> bool:
        return self.ring.used() != 0

    def receive_nowait(self) -> T:
        """Receive without waiting; raises trio.WouldBlock when the ring is empty."""
        self._check_open()
        if self._lock.locked():
            raise trio.WouldBlock
        message = self._try_receive()
        if message is not _EMPTY:
            return message
        self._raise_if_ended()
        raise trio.WouldBlock

    def _raise_if_ended(self) -> None:
        ring = self.ring
        if ring.sender_closed and ring.used() == 0:
            raise trio.EndOfChannel
        if self._peer_gone() and ring.used() == 0:
            raise self._peer_died_error()

    async def receive(self) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        if not self._lock.locked():
            message = self._try_receive()
            if message is not _EMPTY:
                now = time.perf_counter()  # see send(): a shielded yield every FAIRNESS_SECONDS
                if now - self._last_yield >= FAIRNESS_SECONDS:
                    self._last_yield = now
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return message
        async with self._lock:
            attempt = 0
            while True:
                self._check_open()
                message = self._try_receive()
                if message is not _EMPTY:
                    return message
                self._raise_if_ended()
                await self._sleep(self._has_data, attempt)
                attempt += 1

    def __aiter__(self) -> "ShmReceiveChannel[T]":
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Close the receiving half: the sender's next send raises BrokenResourceError."""
        if self._closed:
            return
        self.ring.close_receiver()
        self._notify()
        self._release()


def open_sender(spec: ChannelSpec) -> ShmSendChannel[Any]:
    """Attach the sending half of a channel in this process."""
    return ShmSendChannel(spec)


def open_receiver(spec: ChannelSpec, message_type: Any) -> ShmReceiveChannel[Any]:
    """Attach the receiving half, decoding every frame as ``message_type`` (a Struct or a
    tagged union of Structs)."""
    return ShmReceiveChannel(spec, message_type)


__all__ = [
    "ChannelDecodeError",
    "ChannelStatistics",
    "CorruptFrameError",
    "PeerDiedError",
    "ShmReceiveChannel",
    "ShmSendChannel",
    "open_receiver",
    "open_sender",
]
