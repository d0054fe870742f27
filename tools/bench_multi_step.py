"""The batch-1 decode graph's replay against the multi-step graph's, device time only (GPU).

    python tools/bench_multi_step.py --model-path DIR [--steps 4] [--replays 200]

Why: through the engine, ``--decode-steps 4`` ran each step ~30 us slower than one step a
replay although its kernels were as fast: every kernel started ~0.35 us later after the one
before (docs/gpu_notes.md, variant 75). This times the captured graphs back to back with CUDA
events, nothing between them, in one process: several captures of the one-step graph and of the
N-step graph (each capture its own memory pool), timed in interleaved rounds, so that what a
capture's own placement does to its replay shows apart from the N steps' structure. Each replay repeats the same step (position 540 of one sequence, the same slots): a timing, not a decode.
"""

from __future__ import annotations

import argparse

import torch

from app.engine import Engine
from app.engine.cuda_graph import CudaGraphRunner, StaticDecodeInputs
from app.engine.multi_step import MultiStepGraph
from app.ipc.messages import SamplingParams


def time_us(replay, replays: int) -> float:
    for _ in range(10):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--captures", type=int, default=6, help="graphs of each kind captured (each its own pool)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-gemv-pdl", action="store_true", help="the gemv kernels launched plainly")
    args = parser.parse_args()
    engine = Engine(args.model_path, dtype="bfloat16", attention_backend="triton", overlap_schedule=True,
                    cuda_graph_max_bs=1, decode_steps=args.steps, max_total_tokens=20000,
                    gemv_pdl=False if args.no_gemv_pdl else None)
    engine.generate(input_ids=[list(range(1, 513))], sampling_params=SamplingParams(
        max_new_tokens=32, temperature=0.0, ignore_eos=True))  # fills the graphs' inputs with a real step
    runner = engine.scheduler.runner
    single, multi = runner.cuda_graphs, runner.multi_step
    assert single is not None and multi is not None
    n = args.steps
    context = 540  # every graph replays the step at this position of table row 0 (the prompt's KV is there)

    def loaded(inputs: StaticDecodeInputs, steps: int) -> StaticDecodeInputs:
        slots = torch.arange(1000, 1000 + steps, dtype=torch.int64, device=runner.device)
        inputs.fill(steps, [7] * steps, [0] * steps, list(range(context, context + steps)), slots, runner.table)
        return inputs

    with torch.inference_mode():
        loaded(single.inputs, 1)
        loaded(multi.inputs, n)
        graphs = [("one-step 0", single.graphs[1].replay, 1), (f"{n}-step 0", multi.graph.replay, n)]
        kept: list[object] = []
        for i in range(1, args.captures):  # each capture gets its own memory pool: other addresses
            one = CudaGraphRunner(runner.model, runner.decode_backend, runner.table, [1], runner.argmax_keys)
            many = MultiStepGraph(runner.model, runner.decode_backend, runner.table, n, runner.argmax_keys)
            loaded(one.inputs, 1)
            loaded(many.inputs, n)
            kept += [one, many]  # a graph reads its runner's buffers: they must outlive it
            graphs += [(f"one-step {i}", one.graphs[1].replay, 1), (f"{n}-step {i}", many.graph.replay, n)]
        times: dict[str, list[float]] = {name: [] for name, _, _ in graphs}
        for _ in range(args.rounds):  # interleaved: a graph's figure is its own, not the moment's
            for name, replay, steps in graphs:
                times[name].append(time_us(replay, args.replays // steps) / steps)
    for name, figures in times.items():
        print(f"{name:<12} a step: " + "  ".join(f"{us:7.1f}" for us in figures) + " us", flush=True)

if __name__ == "__main__":
    main()
