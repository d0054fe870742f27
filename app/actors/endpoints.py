"""Attaching an actor's channel halves from its configuration, and closing them all."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import msgspec

from app.actors.graph import ALL_EDGES
from app.ipc.channel import ShmReceiveChannel, ShmSendChannel, open_receiver, open_sender
from app.ipc.segment import ChannelSpec


class Endpoints:
    """The halves one actor uses: ``senders[edge]`` and ``receivers[edge]``, by lane-free edge
    name (graph.py): ``actor`` is the role it plays (``ingress``, ``tokenizer``, ...) in its lane.

    A context manager: leaving it closes every half (the peers then see EndOfChannel or
    BrokenResourceError, not a dead process).
    """

    def __init__(self, actor: str, specs: dict[str, Any]) -> None:
        self.senders: dict[str, ShmSendChannel[Any]] = {}
        self.receivers: dict[str, ShmReceiveChannel[Any]] = {}
        self._stack = ExitStack()
        try:
            for name, raw in specs.items():
                spec = raw if isinstance(raw, ChannelSpec) else msgspec.convert(raw, ChannelSpec)
                edge = ALL_EDGES[name]
                if edge.sender == actor:
                    self.senders[name] = self._stack.enter_context(open_sender(spec))
                elif edge.receiver == actor:
                    self.receivers[name] = self._stack.enter_context(open_receiver(spec, edge.message_type))
                else:
                    raise ValueError(f"channel {name!r} does not belong to actor {actor!r}")
        except BaseException:
            self._stack.close()
            raise

    def __enter__(self) -> Endpoints:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()
