"""The frame ring on its own: framing, wraparound, limits, corrupt input (no processes)."""

from __future__ import annotations

import mmap
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.ipc.ring import HEADER_SIZE, CorruptFrameError, FrameTooLargeError, Ring, RingError


def make_ring(capacity: int, name: str = "test") -> tuple[mmap.mmap, Ring]:
    buffer = mmap.mmap(-1, HEADER_SIZE + capacity)
    return buffer, Ring(buffer, name, initialise=True)


def close(buffer: mmap.mmap, ring: Ring) -> None:
    ring.release()
    buffer.close()  # raises BufferError if any view were still alive


def test_frames_round_trip_in_order():
    buffer, ring = make_ring(256)
    try:
        assert ring.try_write(b"hello") is True  # the ring was empty: the reader must be woken
        assert ring.try_write(b"") is False
        assert ring.try_write(b"x" * 100) is False
        assert ring.try_read() == (b"hello", False)
        assert ring.try_read() == (b"", False)
        assert ring.try_read() == (b"x" * 100, False)
        assert ring.try_read() is None
        assert ring.used() == 0
    finally:
        close(buffer, ring)


def test_full_ring_refuses_then_accepts_after_a_read():
    buffer, ring = make_ring(64)
    try:
        assert ring.try_write(b"a" * 24) is True  # 8 + 24 bytes
        assert ring.try_write(b"b" * 24) is False  # 64 bytes: full
        assert ring.try_write(b"c") is None
        ring.want_space(ring.frame_bytes(1))
        payload, wake_sender = ring.try_read()
        assert payload == b"a" * 24 and wake_sender is True  # the waiting sender has its room now
        ring.want_space(0)
        assert ring.try_write(b"c") is False
    finally:
        close(buffer, ring)


def test_frame_larger_than_ring_is_refused_naming_channel_and_sizes():
    buffer, ring = make_ring(128, name="to-scheduler")
    try:
        with pytest.raises(FrameTooLargeError) as info:
            ring.try_write(b"z" * 500)
        message = str(info.value)
        assert "to-scheduler" in message and "500" in message and "128" in message
        assert ring.used() == 0
        assert ring.try_write(b"z" * ring.max_frame) is True  # the largest frame fits exactly
        assert ring.try_read()[0] == b"z" * ring.max_frame
    finally:
        close(buffer, ring)


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.sampled_from([64, 72, 128, 200, 1024]),
    operations=st.lists(st.one_of(st.integers(0, 300), st.just(-1)), min_size=1, max_size=200),
)
def test_ring_matches_a_fifo_model_across_wraparound(capacity, operations):
    """Random frame sizes (some larger than the ring) and reads against a deque."""
    buffer, ring = make_ring(capacity)
    model: deque[bytes] = deque()
    counter = 0
    try:
        for op in operations:
            if op < 0:
                got = ring.try_read()
                if model:
                    assert got is not None and got[0] == model.popleft()
                else:
                    assert got is None
                continue
            counter += 1
            payload = bytes((counter + i) % 251 for i in range(op))
            if op > ring.max_frame:
                with pytest.raises(FrameTooLargeError):
                    ring.try_write(payload)
                continue
            free = ring.capacity - ring.used()
            result = ring.try_write(payload)
            if ring.frame_bytes(op) > free:
                assert result is None
            else:
                assert result is (len(model) == 0)
                model.append(payload)
            assert 0 <= ring.used() <= ring.capacity
        while model:
            assert ring.try_read()[0] == model.popleft()
        assert ring.try_read() is None
    finally:
        close(buffer, ring)


def test_corrupt_length_is_an_error_and_never_reads_outside():
    buffer, ring = make_ring(128, name="fuzzed")
    try:
        ring.try_write(b"abcdefgh")
        # Overwrite the frame's length word with an impossible value.
        buffer[HEADER_SIZE : HEADER_SIZE + 8] = (10**12).to_bytes(8, "little")
        with pytest.raises(CorruptFrameError, match="fuzzed"):
            ring.try_read()
        assert ring.used() == 0  # the garbage was skipped; the ring is usable again
        ring.try_write(b"ok")
        assert ring.try_read()[0] == b"ok"
    finally:
        close(buffer, ring)


@settings(max_examples=100, deadline=None)
@given(garbage=st.binary(min_size=8, max_size=120), claimed=st.integers(8, 128))
def test_fuzzed_ring_bytes_never_escape_the_segment(garbage, claimed):
    """Whatever bytes and write index a broken peer leaves, reads stay in bounds."""
    buffer, ring = make_ring(128)
    try:
        buffer[HEADER_SIZE : HEADER_SIZE + len(garbage)] = garbage
        ring._words[0] = claimed - claimed % 8  # a write index covering the garbage
        try:
            while ring.try_read() is not None:
                pass
        except CorruptFrameError:
            pass
        assert ring.used() == 0
    finally:
        close(buffer, ring)


def test_attaching_to_a_segment_that_is_not_a_ring_fails_clearly():
    buffer = mmap.mmap(-1, HEADER_SIZE + 256)
    try:
        with pytest.raises(RingError, match="not a ring"):
            Ring(buffer, "stray", initialise=False)
    finally:
        buffer.close()
