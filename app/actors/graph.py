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

With ``--ingress-workers N`` the picture above is one *lane*, and there are N of them around
the one scheduler: lane k has its own ingress, tokenizer and detokenizer (actors ``ingress_k``,
``tokenizer_k``, ``detokenizer_k`` for k ≥ 1; lane 0's keep their names and its ingress is the
supervisor's process) and its own six channels, named with the suffix ``_k``. The scheduler
reads every lane's two inputs and sends each request's outputs down the lane it came from.
A worker lane's ingress also has two channels with the supervisor (``supervisor_to_ingress``:
fail, drain and metrics commands; ``ingress_to_supervisor``: its metrics).

An actor opens its channels by their lane-free names (``to_tokenizer``), so the tokenizer,
detokenizer and ingress code is the same in every lane.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from app.ipc.messages import FromIngressWorker, ToDetokenizer, ToIngress, ToIngressWorker, ToScheduler, ToTokenizer
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

# A worker lane's ingress (a process of its own) and the supervisor.
WORKER_EDGES: Mapping[str, Edge] = MappingProxyType({
    "supervisor_to_ingress": Edge("supervisor", "ingress", ToIngressWorker),
    "ingress_to_supervisor": Edge("ingress", "supervisor", FromIngressWorker),
})

ALL_EDGES: Mapping[str, Edge] = MappingProxyType({**EDGES, **WORKER_EDGES})


def lane_actor(role: str, lane: int) -> str:
    """The actor that plays ``role`` in ``lane``: lane 0's keep their plain names (the one
    scheduler is ``scheduler_TP0``), lane k's are ``<role>_k``."""
    if role == "scheduler":
        return "scheduler_TP0"
    return role if lane == 0 else f"{role}_{lane}"


class LaneChannel(NamedTuple):
    """One channel of the graph: its lane-free name, its lane, and its edge."""

    base: str
    lane: int
    edge: Edge

    @property
    def name(self) -> str:
        return self.base if self.lane == 0 else f"{self.base}_{self.lane}"

    @property
    def receiving_actor(self) -> str:
        return lane_actor(self.edge.receiver, self.lane)


def lane_channels(lanes: int) -> list[LaneChannel]:
    """Every channel of a graph of ``lanes`` lanes."""
    channels = [LaneChannel(base, lane, edge) for lane in range(lanes) for base, edge in EDGES.items()]
    channels += [LaneChannel(base, lane, edge) for lane in range(1, lanes) for base, edge in WORKER_EDGES.items()]
    return channels


@dataclass
class ChannelGraph:
    """The supervisor's handles on every channel of the graph; a context manager that closes
    them (once every actor has started and holds its own copies)."""

    resources: dict[str, ChannelResources]
    channels: list[LaneChannel]

    @classmethod
    def create(cls, capacity: int = CHANNEL_BYTES, lanes: int = 1) -> ChannelGraph:
        if lanes < 1:
            raise ValueError(f"a graph has at least one lane, got {lanes}")
        channels = lane_channels(lanes)
        made: dict[str, ChannelResources] = {}
        try:
            for channel in channels:
                made[channel.name] = create_channel(channel.name, capacity)
        except BaseException:
            for resources in made.values():
                resources.close()
            raise
        return cls(made, channels)

    @property
    def lanes(self) -> int:
        return 1 + max(channel.lane for channel in self.channels)

    def specs_for(self, role: str, lane: int = 0) -> dict[str, ChannelSpec]:
        """The channels ``role`` sends or receives on in ``lane``, by lane-free edge name."""
        return {
            channel.base: self.resources[channel.name].spec
            for channel in self.channels
            if channel.lane == lane and role in (channel.edge.sender, channel.edge.receiver)
        }

    def fds_for(self, role: str, lane: int = 0) -> tuple[int, ...]:
        return tuple(fd for spec in self.specs_for(role, lane).values() for fd in spec.fds)

    def __enter__(self) -> ChannelGraph:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the supervisor's descriptors (children keep their inherited copies)."""
        for resources in self.resources.values():
            resources.close()
