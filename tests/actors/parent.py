"""A parent that spawns tiny actors, prints their pids, then waits to be killed."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from app.actors.process import ActorLaunch, spawned_actors  # noqa: E402
from app.actors.supervisor import Supervisor  # noqa: E402
from app.observability.logs import configure_logging  # noqa: E402

HERE = str(Path(__file__).resolve().parent)


def main() -> None:
    configure_logging("test_parent")
    launches = [
        ActorLaunch(f"tiny{i}", "tiny_actor", msgspec.json.encode({"mode": "ok"}),
                    env={"PYTHONPATH": HERE + ":" + str(Path(HERE).parents[1])})
        for i in range(2)
    ]

    async def body(supervisor: Supervisor) -> None:
        async with supervisor.supervising():
            print(" ".join(str(actor.pid) for actor in supervisor.actors), flush=True)
            await trio.sleep_forever()

    with spawned_actors(launches) as actors:
        trio.run(body, Supervisor(actors, ready_timeout=30))


if __name__ == "__main__":
    main()
