"""The channel graph of the server, in one place (the README draws the same picture)::

    ingress ──to_tokenizer──▶ tokenizer ──tokenizer_to_scheduler──▶ scheduler
       ▲  ▲                      │                                  │   ▲
       │  └─tokenizer_to_ingress─┘ (rejections)      to_detokenizer │   │ detokenizer_to_scheduler
       │                                                            ▼   │ (stop strings)
       └──────────────────detokenizer_to_ingress───────────────── detokenizer

Requests, aborts and control messages all travel ingress → tokenizer → scheduler, so an
abort or a control message reaches the scheduler after the requests sent before it. Control
replies travel scheduler → detokenizer → ingress, behind the outputs produced before them.
Each channel is single-producer, single-consumer: one sending and one receiving actor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from app.ipc.messages import ToDetokenizer, ToIngress, ToScheduler, ToTokenizer
from app.ipc.segment import ChannelResources, ChannelSpec, create_channel

CHANNEL_BYTES = 8 * 1024 * 1024  # six of these fit Docker's default 64 MiB /dev/shm


class Edge(NamedTuple):
    sender: str
    receiver: str
    message_type: object


EDGES: Mapping[str, Edge] = MappingProxyType({
    "to_tokenizer": Edge("ingress", "tokenizer", ToTokenizer),
    "tokenizer_to_scheduler": Edge("tokenizer", "scheduler", ToScheduler),
    "tokenizer_to_ingress": Edge("tokenizer", "ingress", ToIngress),
    "to_detokenizer": Edge("scheduler", "detokenizer", ToDetokenizer),
    "detokenizer_to_scheduler": Edge("detokenizer", "scheduler", ToScheduler),
    "detokenizer_to_ingress": Edge("detokenizer", "ingress", ToIngress),
})


@dataclass
class ChannelGraph:
    """The supervisor's handles on every channel of the graph; a context manager that closes
    them (once every actor has started and holds its own copies)."""

    resources: dict[str, ChannelResources]

    @classmethod
    def create(cls, capacity: int = CHANNEL_BYTES) -> ChannelGraph:
        made: dict[str, ChannelResources] = {}
        try:
            for name in EDGES:
                made[name] = create_channel(name, capacity)
        except BaseException:
            for resources in made.values():
                resources.close()
            raise
        return cls(made)

    def specs_for(self, actor: str) -> dict[str, ChannelSpec]:
        """The channels ``actor`` sends or receives on, by edge name."""
        return {
            name: self.resources[name].spec
            for name, edge in EDGES.items()
            if actor in (edge.sender, edge.receiver)
        }

    def fds_for(self, actor: str) -> tuple[int, ...]:
        return tuple(fd for spec in self.specs_for(actor).values() for fd in spec.fds)

    def __enter__(self) -> ChannelGraph:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the supervisor's descriptors (children keep their inherited copies)."""
        for resources in self.resources.values():
            resources.close()
