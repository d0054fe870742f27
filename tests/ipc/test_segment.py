"""Creating channels: no name left in /dev/shm, descriptors released, clear errors."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from app.ipc import create_channel, open_receiver, open_sender
from app.ipc.messages import ToScheduler


def test_no_name_stays_in_dev_shm_while_the_channel_lives(open_fd_count):
    before_fds = open_fd_count()
    before = set(os.listdir("/dev/shm"))
    resources = create_channel("named", 1 << 16)
    try:
        assert set(os.listdir("/dev/shm")) == before
        sender, receiver = open_sender(resources.spec), open_receiver(resources.spec, ToScheduler)
        sender.close()
        receiver.close()
    finally:
        resources.close()
    assert open_fd_count() <= before_fds


def test_capacity_rounds_up_to_whole_pages():
    resources = create_channel("rounded", 5000)
    try:
        assert (resources.spec.capacity + 512) % os.sysconf("SC_PAGE_SIZE") == 0
        assert resources.spec.capacity >= 5000
    finally:
        resources.close()


def test_a_full_dev_shm_is_a_clear_error_at_creation(monkeypatch, open_fd_count):
    """posix_fallocate is the system call that fails on a small /dev/shm (ENOSPC)."""
    before_fds = open_fd_count()

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(OSError, match=r"channel 'to-scheduler': /dev/shm cannot hold") as info:
        create_channel("to-scheduler", 1 << 20)
    assert info.value.errno == errno.ENOSPC
    assert open_fd_count() <= before_fds  # every descriptor made on the way was closed


def test_a_descriptor_that_is_not_open_is_a_clear_error():
    resources = create_channel("gone", 4096)
    resources.close()
    # the descriptor number may already be reused by another file
    with pytest.raises((OSError, ValueError), match="channel .gone."):
        open_sender(resources.spec)
    assert not any(name.startswith("app-") for name in os.listdir(Path("/dev/shm")))
