"""Checks that apply to every test: nothing may be left behind in /dev/shm."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

# Segments that libraries outside this project make (multiprocessing semaphores, torch).
_FOREIGN_PREFIXES = ("sem.mp-", "pym-", "torch_")


def _shm_entries() -> set[str]:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return set()
    return {entry.name for entry in shm.iterdir() if not entry.name.startswith(_FOREIGN_PREFIXES)}


@pytest.fixture(autouse=True)
def nothing_left_in_dev_shm():
    before = _shm_entries()
    yield
    left = _shm_entries() - before
    assert not left, f"test left shared-memory segments behind: {sorted(left)}"


@pytest.fixture
def open_fd_count():
    """Number of descriptors this process holds; compare before and after a test body. Garbage
    is collected first: an earlier test's unreachable file or socket, closed by the collector
    in the middle of a later test, made a channel's check see one descriptor fewer than before
    (CI, 12-01). A leak check asserts no more descriptors after than before."""
    def count() -> int:
        gc.collect()
        return len(os.listdir("/proc/self/fd"))
    return count
