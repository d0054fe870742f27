"""Offline throughput: N requests of given input/output lengths through the offline Engine.

    python tools/bench_offline.py [--model-path DIR] [--num-prompts 64] [--input-len 256]
                                  [--output-len 64] [--repeats 1] [<engine flag>]...
                                  (the server's engine flags: --device, --max-total-tokens,
                                  --disable-cuda-graph, --kernel-options KEY=VALUE,..., ...)

Prompts are random token ids (fixed seed), generation ignores EOS so every request produces
exactly --output-len tokens. The last line printed is one JSON object with the figures and
the kernel plan that ran.

``--repeats N``: the measured run N times in this process (the prefix cache flushed before each),
the figures those of the median run by elapsed time, and ``runs_output_tokens_per_s`` each run's.
Why: a single run carries outliers of ~1 % at batch 1 on the H200, which read as differences
between machines; the median of five runs in a process varies by ~0.2 % (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine import Engine  # noqa: E402
from app.engine.config import EngineConfig  # noqa: E402
from app.engine.step_results import StepTiming  # noqa: E402
from app.flags import add_flags, flag_values  # noqa: E402
from app.ipc.messages import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    add_flags(parser.add_argument_group("engine"), EngineConfig)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="measured runs in this process (figures: the median's)")
    options = parser.parse_args()
    if options.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {options.repeats}")

    build_started = time.perf_counter()
    engine = Engine(options.model_path, **flag_values(options, EngineConfig))
    build_s = time.perf_counter() - build_started
    vocab = engine.built.model_config.vocab_size
    rng = random.Random(options.seed)
    prompts = [[rng.randrange(vocab) for _ in range(options.input_len)] for _ in range(options.num_prompts)]
    params = SamplingParams(max_new_tokens=options.output_len, temperature=0.0, ignore_eos=True)
    # Warm-up on the measured run's shape (other prompts, as many output tokens): triton compiles
    # a kernel again for each new specialisation of its integer arguments (multiples of 16, ones),
    # which the prefill chunks and the growing contexts of this workload meet; a compile inside
    # the measured run would cost more than half of a short run. (The first run of a device call
    # is still slower than the same run later unless a process of the same workload ran before
    # it: run a warm-up process first.) With the measured run's own sampling parameters: a greedy
    # run's sampler kernels (the prompt's argmax, the greedy record) load lazily at their first
    # use, ~2.5 ms each, which a warm-up that samples would leave inside the measured run.
    warm = [[rng.randrange(vocab) for _ in range(options.input_len)] for _ in range(options.num_prompts)]
    engine.generate(input_ids=warm, sampling_params=params)
    runs = [_measured_run(engine, prompts, params) for _ in range(options.repeats)]
    median = sorted(runs, key=lambda run: run.elapsed_s)[(len(runs) - 1) // 2]
    elapsed, steps, results, timing = median
    output_tokens = median.output_tokens
    input_tokens = sum(r.prompt_tokens for r in results)
    figures = {
        "device": str(engine.built.device),
        "dtype": str(engine.built.dtype).removeprefix("torch."),
        "model": engine.built.model_config.architecture,
        "cuda_graph_max_bs": max(engine.built.cuda_graph_batch_sizes, default=0),  # 0: no graphs
        "kernel_plan": engine.built.plan.as_dict(),
        "decode_tiling": engine.built.decode_tiling,
        "prefill_graph_tokens": list(engine.built.prefill_graph_tokens),
        "build_s": round(build_s, 2),
        "cuda_graph_capture_s": engine.built.cuda_graph_capture_s,
        "model_path": options.model_path,
        "num_prompts": options.num_prompts,
        "input_len": options.input_len,
        "output_len": options.output_len,
        "elapsed_s": round(elapsed, 3),
        "input_tokens_per_s": round(input_tokens / elapsed, 1),
        "output_tokens_per_s": median.output_tokens_per_s,
        "total_tokens_per_s": round((input_tokens + output_tokens) / elapsed, 1),
        "requests_per_s": round(len(results) / elapsed, 2),
        "forward_steps": steps,
        "ms_per_step": round(1000 * elapsed / max(steps, 1), 3),
        "retractions": engine.scheduler.retractions,
        "step_timing": timing,
    }
    if options.repeats > 1:
        figures["runs_output_tokens_per_s"] = [run.output_tokens_per_s for run in runs]
    print(json.dumps(figures))


class MeasuredRun(NamedTuple):
    elapsed_s: float
    steps: int  # forward steps
    results: list  # the engine's results, one a prompt
    timing: dict  # the run's step timing (StepTiming.as_dict)

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.results)

    @property
    def output_tokens_per_s(self) -> float:
        return round(self.output_tokens / self.elapsed_s, 1)


def _measured_run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> MeasuredRun:
    """One measured run on an empty prefix cache."""
    engine.scheduler.memory.flush_cache()
    steps_before = engine.scheduler.forward_steps
    engine.scheduler.timing = StepTiming()  # this run's only
    start = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    return MeasuredRun(elapsed, engine.scheduler.forward_steps - steps_before, results, engine.scheduler.timing.as_dict())


if __name__ == "__main__":
    main()
