"""Heartbeats: how each actor shows the watchdog that it makes progress, without being asked.

The supervisor makes one small shared memory before it spawns the actors (a ``memfd``: it never
has a name, so nothing can be left behind in /dev/shm however a process dies) and each actor
inherits its descriptor. Each actor owns one cache line of it and writes two words::

    line i (64 bytes, actor i)
      word 0  beats   grows by one each time the actor finishes a piece of work
                      (a message handled; for the scheduler, a turn of its loop: a step)
      word 1  busy    1 while it has work in hand (a message taken, requests to step), else 0

Writing is two aligned 8-byte stores, no system call: cheap enough for every message. The
supervisor reads the words whenever it likes (app/actors/watchdog.py): an actor that is busy
and whose beats stay the same is not making progress, whether its step hangs or the process
is stopped; it need not cooperate to be caught.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

LINE_BYTES = 64
_WORDS_PER_LINE = LINE_BYTES // 8
_BEATS = 0
_BUSY = 1

T = TypeVar("T")


class Pulse(NamedTuple):
    """One actor's two words, as read at one moment."""

    beats: int
    busy: bool


class HeartbeatBoard:
    """The supervisor's side: the shared memory, one line per actor; a context manager that
    unmaps it and closes the descriptor (the actors keep their inherited copies)."""

    def __init__(self, actors: Sequence[str]) -> None:
        self.slots = {name: index for index, name in enumerate(actors)}
        self.fd = os.memfd_create("app-heartbeats", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, max(1, len(actors)) * LINE_BYTES)
            self._map = mmap.mmap(self.fd, max(1, len(actors)) * LINE_BYTES)
        except BaseException:
            os.close(self.fd)
            raise
        self._words = memoryview(self._map).cast("Q")

    def config_for(self, actor: str) -> dict[str, int]:
        """What ``actor``'s configuration carries to find its line (its ``heartbeat`` key)."""
        return {"fd": self.fd, "slot": self.slots[actor]}

    def read(self, actor: str) -> Pulse:
        base = self.slots[actor] * _WORDS_PER_LINE
        return Pulse(self._words[base + _BEATS], bool(self._words[base + _BUSY]))

    def close(self) -> None:
        if self.fd < 0:
            return
        self._words.release()
        self._map.close()
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> HeartbeatBoard:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Heartbeat:
    """An actor's side: its own line of the board. Only the actor's trio thread writes it."""

    def __init__(self, fd: int, slot: int) -> None:
        size = os.fstat(fd).st_size
        if (slot + 1) * LINE_BYTES > size:
            raise ValueError(f"heartbeat slot {slot} is outside the board ({size} bytes)")
        self._map = mmap.mmap(fd, size)
        self._words = memoryview(self._map).cast("Q")
        self._base = slot * _WORDS_PER_LINE

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Heartbeat | None:
        """The actor's heartbeat from its configuration; None without one (tests, tools)."""
        spec = config.get("heartbeat")
        return None if not spec else cls(int(spec["fd"]), int(spec["slot"]))

    def busy(self) -> None:
        """Work taken in hand: from now on, beats must grow."""
        self._words[self._base + _BUSY] = 1

    def beat(self, busy: bool) -> None:
        """A piece of work finished; ``busy``: whether more is in hand."""
        self._words[self._base + _BEATS] += 1
        self._words[self._base + _BUSY] = int(busy)


class BeatingInbox(Generic[T]):
    """An actor's inbox whose every message counts as work: busy from when it is taken until
    the actor asks for the next one (which is a beat)."""

    def __init__(self, inbox: Any, heartbeat: Heartbeat) -> None:
        self.inbox = inbox
        self.heartbeat = heartbeat
        self._messages: AsyncIterator[T] | None = None
        self._in_hand = False  # a message was handed out and its work is not over

    def __aiter__(self) -> BeatingInbox[T]:
        self._messages = aiter(self.inbox)
        return self

    async def __anext__(self) -> T:
        if self._in_hand:
            self._in_hand = False
            self.heartbeat.beat(False)
        assert self._messages is not None
        message = await anext(self._messages)
        self.heartbeat.busy()
        self._in_hand = True
        return message


def beating(inbox: Any, heartbeat: Heartbeat | None) -> Any:
    """``inbox`` with its messages counted as work by ``heartbeat``; itself without one."""
    return inbox if heartbeat is None else BeatingInbox(inbox, heartbeat)
