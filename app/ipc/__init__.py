"""Shared-memory ring-buffer channels between actor processes, and the message protocol.

- :mod:`app.ipc.messages`: every message between actors (one tagged union per channel).
- :mod:`app.ipc.segment`: creating a channel's segment and eventfds, handing them to children.
- :mod:`app.ipc.ring`: the single-producer / single-consumer frame ring (bytes, no waiting).
- :mod:`app.ipc.channel`: trio send/receive halves over a ring, with trio's channel contract.
"""

from app.ipc.channel import (
    ChannelDecodeError,
    ChannelStatistics,
    PeerDiedError,
    ShmReceiveChannel,
    ShmSendChannel,
    open_receiver,
    open_sender,
)
from app.ipc.ring import CorruptFrameError, FrameTooLargeError, RingError
from app.ipc.segment import ChannelResources, ChannelSpec, create_channel

__all__ = [
    "ChannelDecodeError",
    "ChannelResources",
    "ChannelSpec",
    "ChannelStatistics",
    "CorruptFrameError",
    "FrameTooLargeError",
    "PeerDiedError",
    "RingError",
    "ShmReceiveChannel",
    "ShmSendChannel",
    "create_channel",
    "open_receiver",
    "open_sender",
]
