"""The watchdog's judgement, sample by sample (``Watchdog.check`` at chosen times): real
heartbeat memory, real channels of the server's graph, tiny real actor processes for names.

An actor is stalled while it has work (busy, or input waiting on a channel) and neither its
beats nor its inputs' read indices move; the earliest stall is the one reported."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import trio

from app.actors.graph import EDGES, ChannelGraph
from app.actors.heartbeat import BeatingInbox, Heartbeat, HeartbeatBoard
from app.actors.process import ActorLaunch, spawned_actors
from app.actors.watchdog import ActorStalled, ChannelGauges, Watchdog
from app.ipc.channel import open_receiver, open_sender
from app.ipc.messages import StepOutput

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NAMES = ("tokenizer", "scheduler_TP0", "detokenizer")
TIMEOUT = 10.0


@pytest.fixture
def parts():
    """The board, the graph's gauges, the three actors, and a heartbeat writer per actor."""
    launches = [ActorLaunch(name, "tiny_actor", msgspec.json.encode({"mode": "ok"}),
                            env={"PYTHONPATH": f"{HERE}:{ROOT}"}) for name in NAMES]
    with (HeartbeatBoard(NAMES) as board, ChannelGraph.create(capacity=65536) as graph,
          ChannelGauges(graph) as gauges, spawned_actors(launches) as actors):
        beats = {name: Heartbeat(board.fd, board.slots[name]) for name in NAMES}
        yield board, graph, gauges, actors, beats


def test_a_busy_actor_whose_beats_stay_still_for_the_timeout_is_stalled(parts):
    board, _, gauges, actors, beats = parts
    watchdog = Watchdog(TIMEOUT, actors, board, gauges)
    beats["scheduler_TP0"].beat(busy=True)
    assert watchdog.check(0.0) is None
    assert watchdog.check(5.0) is None  # stalled since 0.0, not for long enough
    stalled = watchdog.check(10.0)
    assert isinstance(stalled, ActorStalled) and stalled.actor == "scheduler_TP0"
    assert stalled.summary == "app::scheduler_TP0 made no progress for 10.0 s (watchdog)"
    assert stalled.report["busy"] is True and stalled.report["stalled_s"] == 10.0
    assert stalled.returncode is None  # it still runs: the server kills it after the dump


def test_beats_that_move_or_an_idle_actor_are_never_a_stall(parts):
    board, _, gauges, actors, beats = parts
    watchdog = Watchdog(TIMEOUT, actors, board, gauges)
    beats["scheduler_TP0"].beat(busy=True)
    for second in range(0, 60, 5):
        beats["scheduler_TP0"].beat(busy=True)  # a step finished: progress
        assert watchdog.check(float(second)) is None
    beats["scheduler_TP0"].beat(busy=False)  # idle: nothing is expected of it
    for second in range(60, 120, 5):
        assert watchdog.check(float(second)) is None


def test_input_left_unread_stalls_its_receiver_and_reading_it_is_progress(parts):
    board, graph, gauges, actors, _ = parts
    watchdog = Watchdog(TIMEOUT, actors, board, gauges)
    spec = graph.resources["to_detokenizer"].spec
    with open_sender(spec) as sender, open_receiver(spec, EDGES["to_detokenizer"].message_type) as receiver:
        sender.send_nowait(StepOutput(()))  # the detokenizer's heartbeat says idle: only the channel shows it
        assert watchdog.check(0.0) is None
        assert watchdog.check(9.0) is None
        receiver.receive_nowait()
        assert watchdog.check(10.0) is None  # it took its input
        sender.send_nowait(StepOutput(()))
        assert watchdog.check(11.0) is None
        stalled = watchdog.check(21.0)
    assert stalled is not None and stalled.actor == "detokenizer"
    assert stalled.report["unread_bytes"]["to_detokenizer"] > 0 and stalled.report["busy"] is False


def test_the_earliest_stall_is_the_one_reported(parts):
    board, _, gauges, actors, beats = parts
    watchdog = Watchdog(TIMEOUT, actors, board, gauges)
    beats["detokenizer"].busy()
    assert watchdog.check(0.0) is None  # the detokenizer is stuck from here
    beats["scheduler_TP0"].beat(busy=True)
    assert watchdog.check(3.0) is None  # the scheduler from here (blocked on the detokenizer, say)
    assert watchdog.check(12.0).actor == "detokenizer"


def test_the_timeout_must_be_positive(parts):
    board, _, gauges, actors, _ = parts
    with pytest.raises(ValueError, match="--watchdog-timeout must be positive"):
        Watchdog(0, actors, board, gauges)


async def test_an_inbox_message_is_work_until_the_next_is_asked_for():
    with HeartbeatBoard(["tokenizer"]) as board:
        heartbeat = Heartbeat(board.fd, 0)
        send, receive = trio.open_memory_channel[int](4)
        for message in (1, 2):
            send.send_nowait(message)
        send.close()
        seen = []
        async for message in BeatingInbox(receive, heartbeat):
            seen.append((message, board.read("tokenizer")))
        assert [(m, pulse.busy, pulse.beats) for m, pulse in seen] == [(1, True, 0), (2, True, 1)]
        assert board.read("tokenizer") == (2, False)  # asking past the last one ended its work too
