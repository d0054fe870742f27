"""A batch-1 Engine and its requests of one random prompt each, as lab/tools/profile_request.py and
lab/tools/bench_start_streams.py time them: greedy, EOS ignored, and the prefix cache flushed after
each, so that every prompt is a full prefill as in the batch-1 bench."""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))  # for engine_flags

from app.engine import Engine  # noqa: E402
from app.ipc.messages import SamplingParams  # noqa: E402
from engine_flags import add_engine_switches, engine_switches  # noqa: E402


def add_request_options(parser: argparse.ArgumentParser, output_len: int) -> None:
    """The checkpoint, the request's shape and the engine's switches (``--output-len`` defaults
    to ``output_len``)."""
    parser.add_argument("--model-path", default=None, help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=output_len)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=1)
    add_engine_switches(parser)


def build_engine(options: argparse.Namespace) -> Engine:
    return Engine(options.model_path, device=options.device, dtype=options.dtype,
                  cuda_graph_max_bs=options.cuda_graph_max_bs, **engine_switches(options))


def request_runner(engine: Engine, options: argparse.Namespace) -> Callable[[], None]:
    """A function that serves one request of ``--input-len`` random tokens (a new prompt each
    call, from a fixed seed) and ``--output-len`` output tokens, then flushes the prefix cache."""
    vocab = engine.built.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=options.output_len, temperature=0.0, ignore_eos=True)

    def request() -> None:
        prompt = [rng.randrange(vocab) for _ in range(options.input_len)]
        engine.generate(input_ids=[prompt], sampling_params=params)
        engine.scheduler.memory.flush_cache()

    return request
