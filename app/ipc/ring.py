"""A single-producer / single-consumer ring of length-prefixed frames in shared memory.

This module knows bytes, not messages, and never blocks or awaits: ``try_write`` and
``try_read`` either complete at once or report that they cannot. Waiting, wake-ups and
peer death belong to :mod:`app.ipc.channel`.

Segment layout (every header word on its own 64-byte cache line, so the producer and the
consumer never write the same line)::

    offset   0  write_index      bytes ever written   (producer writes, consumer reads)
    offset  64  read_index       bytes ever consumed  (consumer writes, producer reads)
    offset 128  sender_pid       0 until the sender attaches
    offset 136  sender_closed    1 once the sender closed its half
    offset 192  receiver_pid     0 until the receiver attaches
    offset 200  receiver_closed  1 once the receiver closed its half
    offset 256  space_wanted     bytes a blocked sender waits for (0: none waiting)
    offset 448  magic, 456 capacity   checked on attach
    offset 512  data[capacity]

    a frame at data[i % capacity]:  | u64 length | payload (may wrap) | pad to 8 |

Indices only grow (a u64 never wraps in practice), so ``write_index - read_index`` is the
fill level and ``index % capacity`` the position. Frames start 8-byte aligned and capacity
is a multiple of 8, so a length word never straddles the end; a payload may, and is then
copied in two pieces.

Every index is read and written as one aligned 8-byte word through ``memoryview.cast("Q")``
(a single machine store), never with ``struct.pack_into``, which writes byte by byte and
lets the other process read a torn value. The payload is written before the write index
that publishes it; on x86-64 (TSO) stores become visible in that order.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import NamedTuple, TypeVar

T = TypeVar("T")

HEADER_SIZE = 512
FRAME_HEADER = 8
MAGIC = 0x4150505F52494E47  # "APP_RING"

# Word offsets (in units of 8 bytes) into the header.
_WRITE = 0
_READ = 8
_SENDER_PID = 16
_SENDER_CLOSED = 17
_RECEIVER_PID = 24
_RECEIVER_CLOSED = 25
_SPACE_WANTED = 32
_MAGIC = 56
_CAPACITY = 57


class RingError(Exception):
    """Base of the ring's own errors; always names the channel."""


class FrameTooLargeError(RingError, ValueError):
    """A frame that could never fit in the ring (splitting it could not be cancellation-safe)."""


class CorruptFrameError(RingError):
    """The ring holds bytes that are not a valid frame: the other side is broken or hostile."""


def _align8(n: int) -> int:
    return (n + 7) & ~7


def segment_size(capacity: int) -> int:
    """Bytes of shared memory a ring of ``capacity`` data bytes needs."""
    return HEADER_SIZE + capacity


def round_capacity(capacity: int) -> int:
    """Round a requested capacity up so that header plus data fill whole pages."""
    if capacity < 64:
        raise ValueError(f"ring capacity must be at least 64 bytes, got {capacity}")
    page = mmap.PAGESIZE
    return ((HEADER_SIZE + capacity + page - 1) // page) * page - HEADER_SIZE


class Ring:
    """Frames over one mapped segment. One process writes, one process reads.

    The ring does not own the mapping's lifetime beyond its views: call :meth:`release`
    before closing the mmap (``mmap.close()`` raises BufferError while views live).
    """

    def __init__(self, buffer: mmap.mmap, name: str, *, initialise: bool) -> None:
        self.name = name
        self._words = memoryview(buffer)[:HEADER_SIZE].cast("Q")
        self._data = memoryview(buffer)[HEADER_SIZE:]
        self.capacity = len(self._data)
        # The data region as 8-byte words, for frame length words (frames start 8-aligned).
        self._data_words = self._data[: self.capacity & ~7].cast("Q")
        if initialise:
            if self.capacity % 8 or self.capacity < 64:
                raise ValueError(f"channel {name!r}: capacity {self.capacity} must be a multiple of 8, >= 64")
            for word in range(HEADER_SIZE // 8):
                self._words[word] = 0
            self._words[_CAPACITY] = self.capacity
            self._words[_MAGIC] = MAGIC
        elif self._words[_MAGIC] != MAGIC or self._words[_CAPACITY] != self.capacity:
            magic, capacity = self._words[_MAGIC], self._words[_CAPACITY]
            self.release()
            raise RingError(
                f"channel {name!r}: segment is not a ring of {len(buffer) - HEADER_SIZE} bytes "
                f"(magic {magic:#x}, capacity {capacity})"
            )

    @property
    def max_frame(self) -> int:
        """The largest payload a frame may carry."""
        return self.capacity - FRAME_HEADER

    # ------------------------------------------------------------ shared flags

    def _get(self, word: int) -> int:
        return self._words[word]

    def _set(self, word: int, value: int) -> None:
        self._words[word] = value

    @property
    def write_index(self) -> int:
        return self._words[_WRITE]

    @property
    def read_index(self) -> int:
        return self._words[_READ]

    def used(self) -> int:
        """Bytes currently in the ring (frame headers and padding included)."""
        return self._words[_WRITE] - self._words[_READ]

    @property
    def sender_pid(self) -> int:
        return self._words[_SENDER_PID]

    @property
    def receiver_pid(self) -> int:
        return self._words[_RECEIVER_PID]

    def mark_sender(self, pid: int) -> None:
        self._words[_SENDER_PID] = pid

    def mark_receiver(self, pid: int) -> None:
        self._words[_RECEIVER_PID] = pid

    @property
    def sender_closed(self) -> bool:
        return self._words[_SENDER_CLOSED] != 0

    @property
    def receiver_closed(self) -> bool:
        return self._words[_RECEIVER_CLOSED] != 0

    def close_sender(self) -> None:
        self._words[_SENDER_CLOSED] = 1

    def close_receiver(self) -> None:
        self._words[_RECEIVER_CLOSED] = 1

    @property
    def space_wanted(self) -> int:
        return self._words[_SPACE_WANTED]

    def want_space(self, nbytes: int) -> None:
        """Producer: record that it sleeps until ``nbytes`` are free (0: not sleeping)."""
        self._words[_SPACE_WANTED] = nbytes

    # ------------------------------------------------------------ producer side

    def frame_bytes(self, payload_len: int) -> int:
        """Ring bytes one frame of ``payload_len`` occupies; refuses frames that can never fit."""
        if payload_len > self.max_frame:
            raise FrameTooLargeError(
                f"channel {self.name!r}: a {payload_len}-byte message does not fit in the "
                f"{self.capacity}-byte ring (at most {self.max_frame} bytes per message)"
            )
        return FRAME_HEADER + _align8(payload_len)

    def try_write(self, payload: bytes | bytearray | memoryview) -> bool | None:
        """Append one frame if there is room.

        Returns None when the ring lacks room (nothing written), else whether the ring was
        empty before this frame (the consumer may be asleep: the caller must wake it).
        Raises FrameTooLargeError for a payload that could never fit.
        """
        size = len(payload)
        if size > self.capacity - FRAME_HEADER:
            self.frame_bytes(size)  # raises, naming the channel and both sizes
        need = FRAME_HEADER + ((size + 7) & ~7)
        words = self._words
        write = words[_WRITE]
        capacity = self.capacity
        if capacity - (write - words[_READ]) < need:
            return None
        pos = write % capacity
        self._data_words[pos >> 3] = size  # the length word: aligned, never wraps
        start = pos + FRAME_HEADER
        if start == capacity:
            start = 0
        end = start + size
        data = self._data
        if end <= capacity:
            data[start:end] = payload
        else:  # the payload wraps: two copies, from a view (slicing a bytearray would copy it)
            first = capacity - start
            with memoryview(payload) as view:
                data[start:] = view[:first]
                data[: size - first] = view[first:]
        words[_WRITE] = write + need  # publish: one 8-byte store, after the payload
        return write == words[_READ]

    # ------------------------------------------------------------ consumer side

    def read_with(self, decode: Callable[[memoryview | bytes], T]) -> tuple[T, bool] | None:
        """Decode the next frame where it lies (a copy only when it wraps) and consume it.

        Returns None when the ring is empty, else ``(decode(payload), wake_producer)``; the
        second says a sleeping producer now has the room it waits for. The frame is consumed
        even when ``decode`` raises (its exception propagates), so one bad frame never blocks
        the channel. Raises CorruptFrameError (after skipping everything in the ring) on a
        length that cannot be right: a broken peer cannot make us read outside the segment.
        """
        words = self._words
        read = words[_READ]
        available = words[_WRITE] - read
        if available == 0:
            return None
        capacity = self.capacity
        if available < FRAME_HEADER or available > capacity or read & 7:
            self._skip_all()
            raise CorruptFrameError(
                f"channel {self.name!r}: ring indices are inconsistent (read {read}, {available} bytes available)"
            )
        pos = read % capacity
        size = self._data_words[pos >> 3]
        consumed = FRAME_HEADER + ((size + 7) & ~7)
        if consumed > available:
            self._skip_all()
            raise CorruptFrameError(
                f"channel {self.name!r}: frame length {size} exceeds the {available - FRAME_HEADER} bytes written"
            )
        start = pos + FRAME_HEADER
        if start == capacity:
            start = 0
        end = start + size
        data = self._data
        try:
            if end <= capacity:
                view = data[start:end]
                try:
                    value = decode(view)
                finally:
                    view.release()  # before the read index moves on and the bytes are reused
            else:
                value = decode(bytes(data[start:]) + bytes(data[: end - capacity]))
        finally:
            read += consumed
            words[_READ] = read
        wanted = words[_SPACE_WANTED]
        return value, wanted != 0 and capacity - (words[_WRITE] - read) >= wanted

    def try_read(self) -> tuple[bytes, bool] | None:
        """Copy out and consume one frame: (payload, producer_needs_wake) or None if empty."""
        return self.read_with(bytes)

    def _skip_all(self) -> None:
        self._words[_READ] = self._words[_WRITE]

    def release(self) -> None:
        """Drop every view of the mapping so that it can be closed."""
        self._words.release()
        self._data_words.release()
        self._data.release()


class RingIndices(NamedTuple):
    """A ring's two indices at one moment: bytes ever written, bytes ever consumed."""

    written: int
    read: int

    @property
    def unread(self) -> int:
        return self.written - self.read


class RingGauge:
    """A read-only view of a ring's indices, for a process that neither sends nor receives on
    it (the watchdog, app/actors/watchdog.py): whether the receiver has input, and takes it."""

    def __init__(self, header: mmap.mmap, name: str) -> None:
        self.name = name
        self._words = memoryview(header)[:HEADER_SIZE].cast("Q")

    def indices(self) -> RingIndices:
        read = self._words[_READ]  # first: the write index read after it is never behind it
        return RingIndices(self._words[_WRITE], read)

    def release(self) -> None:
        self._words.release()
