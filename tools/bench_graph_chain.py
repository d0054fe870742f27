"""What a kernel node costs in a CUDA graph as the graph grows (GPU).

    python tools/bench_graph_chain.py [--nodes 40,80,120,160,240,320] [--replays 200]

Why: a graph of four batch-1 decode steps (``--decode-steps 4``, ~340 kernel nodes) ran every
kernel ~0.35 us later after the one before than the one-step graph (~85 nodes) did, with the
kernels themselves as fast (docs/gpu_notes.md, variant 75). This times chains of K tiny
dependent kernels (an in-place add on 4 KB) captured as one graph, per node, for each K, so
that a step in the per-node cost with the graph's size shows up on its own.
"""

from __future__ import annotations

import argparse

import torch


def per_node_us(nodes: int, replays: int, stream: torch.cuda.Stream | None = None) -> float:
    """Capture a chain of ``nodes`` in-place adds (on ``stream``, or a new one) and time its replays."""
    x = torch.zeros(1024, device="cuda")
    stream = stream if stream is not None else torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(nodes):  # warm-up outside the capture
            x.add_(1.0)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(nodes):
            x.add_(1.0)
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="20,40,80,100,120,128,140,160,200,240,320,480")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--one-stream", action="store_true", help="capture every graph on one stream")
    args = parser.parse_args()
    stream = torch.cuda.Stream() if args.one_stream else None
    for nodes in (int(n) for n in args.nodes.split(",")):
        print(f"{nodes:5d} nodes  {per_node_us(nodes, args.replays, stream):6.3f} us a node", flush=True)


if __name__ == "__main__":
    main()
