"""Creating a channel's kernel objects and handing them to another process.

A channel is one shared-memory segment (the ring) plus two eventfds: ``data_fd`` wakes the
receiver when the ring goes from empty to non-empty, ``space_fd`` wakes a sender blocked on
a full ring. The creating process (the supervisor) makes all three and gives them to the
children that use them as inherited file descriptors (``subprocess.Popen(pass_fds=...)``).

The segment is made with posix-ipc in /dev/shm, its memory is reserved at once with
``posix_fallocate`` (so a /dev/shm that is too small fails here, naming the channel, not
with a SIGBUS on some later write), and its name is unlinked immediately after: the open
descriptor keeps the memory alive and travels to children, so no name exists in /dev/shm
for longer than a few microseconds, whichever process is later killed, and however.
This is stronger than unlinking once every child has attached, which would leave a name
behind if the supervisor were killed during start-up.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
from dataclasses import dataclass, field

import msgspec
import posix_ipc

from app.ipc.ring import HEADER_SIZE, Ring, RingGauge, round_capacity, segment_size

DEFAULT_CAPACITY = 4 * 1024 * 1024


class ChannelSpec(msgspec.Struct, frozen=True):
    """Everything a process needs to attach to a channel; small enough for argv or a pipe.

    The descriptors are only valid in processes that inherited them (or in the creator).
    """

    name: str
    capacity: int
    shm_fd: int
    data_fd: int
    space_fd: int

    @property
    def fds(self) -> tuple[int, int, int]:
        """The descriptors to pass to a child process (``pass_fds``)."""
        return (self.shm_fd, self.data_fd, self.space_fd)


@dataclass
class ChannelResources:
    """The creator's handle on one channel's kernel objects; ``close()`` releases them.

    Children hold their own inherited copies, so the creator may close its descriptors as
    soon as every child that needs them has started.
    """

    spec: ChannelSpec
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in self.spec.fds:
            try:
                os.close(fd)
            except OSError:
                pass


def create_channel(name: str, capacity: int = DEFAULT_CAPACITY) -> ChannelResources:
    """Create the segment and eventfds of one channel and initialise its ring.

    Raises OSError naming the channel when /dev/shm cannot hold the ring. Cleans up every
    descriptor it made when it fails.
    """
    capacity = round_capacity(capacity)
    size = segment_size(capacity)
    shm_name = f"/app-{os.getpid()}-{secrets.token_hex(6)}"
    memory = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, mode=0o600, size=0)
    shm_fd = memory.fd
    fds = [shm_fd]
    try:
        memory.unlink()  # the descriptor keeps the memory; nothing stays in /dev/shm
        try:
            os.posix_fallocate(shm_fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG):
                raise OSError(
                    exc.errno,
                    f"channel {name!r}: /dev/shm cannot hold its {size}-byte ring "
                    f"(is /dev/shm too small? Docker gives 64 MiB unless --shm-size is set)",
                ) from exc
            raise
        os.set_inheritable(shm_fd, False)
        data_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        fds.append(data_fd)
        space_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        fds.append(space_fd)
        with mmap.mmap(shm_fd, size) as buffer:
            Ring(buffer, name, initialise=True).release()
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return ChannelResources(ChannelSpec(name, capacity, shm_fd, data_fd, space_fd))


def map_ring(spec: ChannelSpec) -> tuple[mmap.mmap, Ring]:
    """Map a channel's segment in this process and check that it holds a ring."""
    size = segment_size(spec.capacity)
    try:
        actual = os.fstat(spec.shm_fd).st_size
    except OSError as exc:
        raise OSError(exc.errno, f"channel {spec.name!r}: descriptor {spec.shm_fd} is not open here") from exc
    if actual != size:
        raise ValueError(f"channel {spec.name!r}: segment has {actual} bytes, expected {size}")
    # MAP_POPULATE maps every page now: no page fault on the first pass through the ring.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    buffer = mmap.mmap(spec.shm_fd, size, flags=flags)
    try:
        return buffer, Ring(buffer, spec.name, initialise=False)
    except BaseException:
        buffer.close()
        raise


def map_gauge(spec: ChannelSpec) -> tuple[mmap.mmap, RingGauge]:
    """Map a channel's header, read-only, in a process that only watches it (the supervisor,
    before it closes its copy of the descriptor: the mapping keeps the memory)."""
    length = max(mmap.PAGESIZE, HEADER_SIZE)
    header = mmap.mmap(spec.shm_fd, length, prot=mmap.PROT_READ)
    try:
        return header, RingGauge(header, spec.name)
    except BaseException:
        header.close()
        raise
