"""Channel halves in one process: trio's channel contract, backpressure, cancellation."""

from __future__ import annotations

import msgspec
import pytest
import trio
import trio.testing

from app.ipc import (
    ChannelDecodeError,
    FrameTooLargeError,
    create_channel,
    open_receiver,
    open_sender,
)
from app.ipc.messages import AbortRequest, StopStringHit, ToScheduler


@pytest.fixture
def channel(open_fd_count):
    """A small channel (one page of ring) with both halves in this process."""
    fds_before = open_fd_count()
    resources = create_channel("test-channel", 3584)
    sender = open_sender(resources.spec)
    receiver = open_receiver(resources.spec, ToScheduler)
    yield sender, receiver
    sender.close()
    receiver.close()
    resources.close()
    assert open_fd_count() <= fds_before, "a channel leaked file descriptors"


def abort(i: int, pad: int = 0) -> AbortRequest:
    return AbortRequest(f"r{i}", "x" * pad)


async def test_messages_arrive_in_order_and_iteration_ends_on_close(channel):
    sender, receiver = channel
    async with trio.open_nursery() as nursery:

        async def produce():
            for i in range(500):  # far more bytes than the ring holds: wraps many times
                await sender.send(abort(i, pad=i % 97))
            sender.close()

        nursery.start_soon(produce)
        received = [message async for message in receiver]
    assert received == [abort(i, pad=i % 97) for i in range(500)]
    assert receiver.messages_received == 500


async def test_receiver_gets_end_of_channel_only_after_draining(channel):
    sender, receiver = channel
    await sender.send(abort(1))
    sender.close()
    assert await receiver.receive() == abort(1)
    with pytest.raises(trio.EndOfChannel):
        await receiver.receive()
    with pytest.raises(trio.EndOfChannel):
        receiver.receive_nowait()


async def test_sender_gets_broken_resource_once_receiver_closes(channel):
    sender, receiver = channel
    receiver.close()
    with pytest.raises(trio.BrokenResourceError, match="receiver closed"):
        await sender.send(abort(1))


async def test_using_a_closed_half_raises_closed_resource(channel):
    sender, receiver = channel
    sender.close()
    receiver.close()
    sender.close()  # idempotent
    with pytest.raises(trio.ClosedResourceError):
        await sender.send(abort(1))
    with pytest.raises(trio.ClosedResourceError):
        await receiver.receive()


async def test_closing_wakes_a_local_task_blocked_in_receive(channel):
    _, receiver = channel
    async with trio.open_nursery() as nursery:

        async def blocked():
            with pytest.raises(trio.ClosedResourceError):
                await receiver.receive()

        nursery.start_soon(blocked)
        await trio.sleep(0.05)
        assert receiver.statistics().tasks_waiting_receive == 1
        receiver.close()


async def test_full_ring_blocks_the_sender_until_the_receiver_reads(channel):
    sender, receiver = channel
    sent = 0
    while True:  # fill the ring
        try:
            sender.send_nowait(abort(sent, pad=200))
        except trio.WouldBlock:
            break
        sent += 1
    assert sent > 3
    stats = sender.statistics()
    assert stats.current_buffer_used > stats.max_buffer_size - 300
    done = trio.Event()

    async def send_one_more():
        await sender.send(abort(sent, pad=200))
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_one_more)
        await trio.sleep(0.1)
        assert not done.is_set()  # backpressure: still waiting for room
        assert sender.statistics().tasks_waiting_send == 1
        assert await receiver.receive() == abort(0, pad=200)
        with trio.fail_after(2):
            await done.wait()
    for i in range(1, sent + 1):
        assert receiver.receive_nowait() == abort(i, pad=200)


async def test_many_concurrent_senders_keep_each_senders_order(channel):
    sender, receiver = channel
    tasks, per_task = 20, 50

    async def produce(task: int):
        for i in range(per_task):
            await sender.send(StopStringHit(f"t{task}", str(i)))

    got: dict[str, list[int]] = {}
    async with trio.open_nursery() as nursery:
        for task in range(tasks):
            nursery.start_soon(produce, task)
        for _ in range(tasks * per_task):
            message = await receiver.receive()
            got.setdefault(message.rid, []).append(int(message.stop))
    assert got == {f"t{task}": list(range(per_task)) for task in range(tasks)}


async def test_cancelled_send_writes_nothing(channel):
    sender, receiver = channel
    count = 0
    while True:
        try:
            sender.send_nowait(abort(count, pad=500))
        except trio.WouldBlock:
            break
        count += 1
    with trio.move_on_after(0.1) as scope:
        await sender.send(abort(999, pad=500))  # as large as those that no longer fit
    assert scope.cancelled_caught
    for i in range(count):
        assert await receiver.receive() == abort(i, pad=500)
    with pytest.raises(trio.WouldBlock):
        receiver.receive_nowait()  # the cancelled message was never written
    await sender.send(abort(1000))  # and the channel still works
    assert await receiver.receive() == abort(1000)


async def test_cancelled_receive_consumes_nothing(channel):
    sender, receiver = channel
    with trio.move_on_after(0.05) as scope:
        await receiver.receive()
    assert scope.cancelled_caught
    await sender.send(abort(7))
    assert await receiver.receive() == abort(7)


async def test_cancellation_in_the_middle_of_a_stream_loses_and_duplicates_nothing(channel):
    """Cancel receives and sends at random moments; every message arrives exactly once."""
    sender, receiver = channel
    total = 400
    received: list[AbortRequest] = []

    async def produce():
        i = 0
        while i < total:
            with trio.move_on_after(0.0005):
                await sender.send(abort(i, pad=i % 300))
                i += 1
        sender.close()

    async def consume():
        while True:
            with trio.move_on_after(0.0003):
                try:
                    received.append(await receiver.receive())
                except trio.EndOfChannel:
                    return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        nursery.start_soon(consume)
    assert received == [abort(i, pad=i % 300) for i in range(total)]


async def test_frame_too_large_is_refused_before_waiting(channel):
    sender, receiver = channel
    with pytest.raises(FrameTooLargeError, match="test-channel"):
        await sender.send(abort(0, pad=10_000))
    await sender.send(abort(1))
    assert await receiver.receive() == abort(1)


async def test_undecodable_frame_names_the_channel_and_the_channel_survives(channel):
    sender, receiver = channel
    sender.ring.try_write(b"\xc1 not msgpack")
    sender.ring.try_write(msgspec.msgpack.encode(["Unknown", 1]))
    await sender.send(abort(3))
    with pytest.raises(ChannelDecodeError, match="test-channel"):
        await receiver.receive()
    with pytest.raises(ChannelDecodeError, match="Unknown"):
        await receiver.receive()
    assert await receiver.receive() == abort(3)


async def test_statistics_follow_trios_field_names(channel):
    sender, receiver = channel
    await sender.send(abort(1))
    stats = receiver.statistics()
    assert stats.name == "test-channel"
    assert stats.open_send_channels == 1 and stats.open_receive_channels == 1
    frame = 8 + ((len(msgspec.msgpack.encode(abort(1))) + 7) & ~7)
    assert stats.current_buffer_used == frame
    assert stats.max_buffer_size == sender.ring.capacity
    assert stats.tasks_waiting_send == 0 and stats.tasks_waiting_receive == 0
    sender.close()
    assert receiver.statistics().open_send_channels == 0
