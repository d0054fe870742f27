"""A child process for the two-process channel tests, started as the supervisor starts actors:
from the parent's main thread, with the channel descriptors passed through ``pass_fds`` and
their specs on the command line.

    peer.py MODE PARENT_PID IN_SPEC OUT_SPEC

echo: send back every message received until EndOfChannel; hold: attach both halves and
wait to be killed; idle: block in receive until EndOfChannel; send: send 300 seeded
random-size messages, then close. Prints "ready" once attached.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.actors.lifeline import die_with_parent  # noqa: E402
from app.ipc import ChannelSpec, open_receiver, open_sender  # noqa: E402
from app.ipc.messages import AbortRequest, ToScheduler  # noqa: E402


def seeded_messages(count: int, max_pad: int, seed: int = 1234) -> list[AbortRequest]:
    rng = random.Random(seed)
    return [AbortRequest(f"m{i}", "y" * rng.randrange(max_pad)) for i in range(count)]


async def run(mode: str, receiver, sender) -> None:
    print("ready", flush=True)
    if mode == "echo":
        async for message in receiver:
            await sender.send(message)
        sender.close()
    elif mode == "hold":
        await trio.sleep_forever()
    elif mode == "idle":
        async for _ in receiver:
            pass
    elif mode == "send":
        for message in seeded_messages(300, 3000):
            await sender.send(message)
        sender.close()


def main() -> None:
    mode, parent, in_spec, out_spec = sys.argv[1:5]
    die_with_parent(int(parent))
    receiver = open_receiver(msgspec.json.decode(in_spec, type=ChannelSpec), ToScheduler)
    sender = open_sender(msgspec.json.decode(out_spec, type=ChannelSpec))
    try:
        trio.run(run, mode, receiver, sender)
    finally:
        receiver.close()
        sender.close()
    time.sleep(0)


if __name__ == "__main__":
    main()
