"""A tiny actor for supervision tests; its config's "mode" says how it behaves."""

from __future__ import annotations

import os
import signal
import sys
import time

import trio

from app.actors.child import run_actor
from app.actors.failure_report import exception_report, send_report
from app.observability.logs import get_logger


async def actor_main(config, ready):
    mode = config["mode"]
    log = get_logger()
    if mode == "crash_at_start":
        log.error("cannot load the model: weights are missing")
        raise SystemExit(3)
    if mode == "never_ready":
        await trio.sleep_forever()
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready({"pid": os.getpid(), "mode": mode})
    log.info("serving")
    if mode == "die_later":
        await trio.sleep(0.3)
        log.error("about to fail")
        raise RuntimeError("the tiny actor failed on purpose")
    if mode == "exit_soon":  # a follower: its input ended, it exits 0
        await trio.sleep(0.2)
        return
    if mode == "fail_slowly":  # reports its failure, then takes long to exit (writing a crash dump)
        await trio.sleep(0.1)
        error = RuntimeError("the tiny actor failed slowly")
        send_report(exception_report(error))
        time.sleep(1.2)
        raise error
    if mode == "ignore_term":
        while True:  # SIGTERM is ignored: only SIGKILL ends this
            await trio.sleep(1)
    await trio.sleep_forever()


def main() -> None:
    run_actor(sys.argv[-1].removeprefix("app::"), actor_main)


if __name__ == "__main__":
    main()
