"""Benchmark: our shared-memory Channel against pyzmq over ipc://, between two processes.

Both transports carry the same protocol message (a ``StepOutput`` holding one
``TokenOutput`` padded to the target size), encoded with msgspec, and both are driven from
trio the way an actor would drive them (zmq: non-blocking calls plus ``wait_readable`` on
the socket's descriptor). Latency: one message in flight, echoed back by the child.
Throughput: the parent sends as fast as the transport accepts, the child acknowledges the
last message.

    python tools/bench_ipc.py [--quick]

The last line printed is one JSON object with rtt_p50_us, rtt_p99_us and msgs_per_s,
each keyed by transport ("shm", "zmq") and then by message size in bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.actors.lifeline import die_with_parent  # noqa: E402
from app.ipc import ChannelSpec, create_channel, open_receiver, open_sender  # noqa: E402
from app.ipc.messages import StepOutput, ToDetokenizer, TokenOutput  # noqa: E402

SIZES = (64, 1024, 65536)
RING_BYTES = 8 * 1024 * 1024


def make_message(size: int) -> StepOutput:
    """A protocol message whose msgpack encoding is ``size`` bytes (within a few)."""
    overhead = len(msgspec.msgpack.encode(StepOutput((TokenOutput("bench", b""),))))
    pad = max(0, size - overhead - 4)  # bin8/bin16/bin32 headers grow by up to 4 bytes
    return StepOutput((TokenOutput("bench", b"\0" * pad),))


# ---------------------------------------------------------------- transports


class ShmTransport:
    """Channel halves for one direction each (parent→child, child→parent)."""

    def __init__(self, tx_spec: ChannelSpec, rx_spec: ChannelSpec) -> None:
        self.tx = open_sender(tx_spec)
        self.rx = open_receiver(rx_spec, ToDetokenizer)

    async def send(self, message: Any) -> None:
        await self.tx.send(message)

    async def receive(self) -> Any:
        return await self.rx.receive()

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


class ZmqTransport:
    """PUSH/PULL over ipc://, non-blocking calls awaited with trio on zmq's descriptor."""

    def __init__(self, tx_addr: str, rx_addr: str, *, bind: bool) -> None:
        import zmq

        self._zmq = zmq
        self.context = zmq.Context()
        self.tx = self.context.socket(zmq.PUSH)
        self.rx = self.context.socket(zmq.PULL)
        for sock, addr in ((self.tx, tx_addr), (self.rx, rx_addr)):
            sock.setsockopt(zmq.LINGER, 0)
            (sock.bind if bind else sock.connect)(addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ToDetokenizer)

    async def _wait(self, sock: Any, event: int) -> None:
        # zmq's descriptor is edge-triggered: check EVENTS before sleeping on it.
        if sock.getsockopt(self._zmq.EVENTS) & event:
            return
        with trio.move_on_after(0.02):
            await trio.lowlevel.wait_readable(sock.getsockopt(self._zmq.FD))

    async def send(self, message: Any) -> None:
        payload = self.encoder.encode(message)
        while True:
            try:
                self.tx.send(payload, self._zmq.NOBLOCK, copy=False)
                return
            except self._zmq.Again:
                await self._wait(self.tx, self._zmq.POLLOUT)

    async def receive(self) -> Any:
        while True:
            try:
                return self.decoder.decode(self.rx.recv(self._zmq.NOBLOCK, copy=False).buffer)
            except self._zmq.Again:
                await self._wait(self.rx, self._zmq.POLLIN)

    def close(self) -> None:
        self.tx.close()
        self.rx.close()
        self.context.term()


# ---------------------------------------------------------------- child side


async def child_loop(transport: Any, mode: str, count: int) -> None:
    if mode == "echo":
        for _ in range(count):
            await transport.send(await transport.receive())
    else:  # sink: a warm-up round, then the measured one; acknowledge the end of each
        for rounds in (WARMUP, count):
            for _ in range(rounds):
                await transport.receive()
            await transport.send(StepOutput((TokenOutput("ack", b""),)))


def child_main(argv: list[str]) -> None:
    kind, mode, count, parent, a, b = argv
    die_with_parent(int(parent))
    if kind == "shm":
        transport: Any = ShmTransport(
            msgspec.json.decode(b, type=ChannelSpec), msgspec.json.decode(a, type=ChannelSpec)
        )
    else:
        transport = ZmqTransport(b, a, bind=False)
    try:
        trio.run(child_loop, transport, mode, int(count))
    finally:
        transport.close()


# ---------------------------------------------------------------- parent side


async def measure_rtt(transport: Any, message: Any, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await transport.send(message)
        await transport.receive()
        samples.append(time.perf_counter() - start)
    return samples


async def measure_throughput(transport: Any, message: Any, count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        await transport.send(message)
    await transport.receive()
    return count / (time.perf_counter() - start)


def run_case(kind: str, mode: str, size: int, count: int, workdir: str) -> Any:
    """Start a child for one transport and mode, run the measurement, return its figure."""
    message = make_message(size)
    child_count = count + WARMUP if mode == "echo" else count
    if kind == "shm":
        to_child = create_channel("bench-to-child", RING_BYTES)
        to_parent = create_channel("bench-to-parent", RING_BYTES)
        args = [msgspec.json.encode(to_child.spec).decode(), msgspec.json.encode(to_parent.spec).decode()]
        fds = to_child.spec.fds + to_parent.spec.fds
    else:
        a, b = f"ipc://{workdir}/to-child-{size}-{mode}", f"ipc://{workdir}/to-parent-{size}-{mode}"
        args, fds = [a, b], ()
    # Popen from the main thread, outside trio: the child's PDEATHSIG follows this thread.
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", kind, mode, str(child_count), str(os.getpid()), *args],
        pass_fds=fds,
    )
    try:
        if kind == "shm":
            transport: Any = ShmTransport(to_child.spec, to_parent.spec)
            to_child.close()
            to_parent.close()
        else:
            transport = ZmqTransport(args[0], args[1], bind=True)

        async def body() -> Any:
            if mode == "echo":
                await measure_rtt(transport, message, WARMUP)
                return await measure_rtt(transport, message, count)
            await measure_throughput(transport, message, WARMUP)
            return await measure_throughput(transport, message, count)

        try:
            return trio.run(body)
        finally:
            transport.close()
    finally:
        if child.wait(timeout=60) != 0:
            raise RuntimeError(f"{kind} {mode} child exited with {child.returncode}")


WARMUP = 2000  # messages before measuring: caches, page tables and allocators settle


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (under 30 s)")
    options = parser.parse_args()
    scale = 1 if options.quick else 5
    rtt_counts = {64: 2000 * scale, 1024: 2000 * scale, 65536: 500 * scale}
    tput_counts = {64: 20000 * scale, 1024: 20000 * scale, 65536: 2000 * scale}
    result: dict[str, dict[str, dict[str, float]]] = {"rtt_p50_us": {}, "rtt_p99_us": {}, "msgs_per_s": {}}
    with tempfile.TemporaryDirectory(prefix="bench-ipc-") as workdir:
        for kind in ("shm", "zmq"):
            for key in result:
                result[key][kind] = {}
            for size in SIZES:
                samples = run_case(kind, "echo", size, rtt_counts[size], workdir)
                rate = run_case(kind, "sink", size, tput_counts[size], workdir)
                p50, p99 = percentile(samples, 0.5) * 1e6, percentile(samples, 0.99) * 1e6
                result["rtt_p50_us"][kind][str(size)] = round(p50, 1)
                result["rtt_p99_us"][kind][str(size)] = round(p99, 1)
                result["msgs_per_s"][kind][str(size)] = round(rate)
                print(f"{kind:>4} {size:>6} B  rtt p50 {p50:8.1f} us  p99 {p99:8.1f} us  {rate:10.0f} msg/s", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
