"""What the kernel sweep tools (bench_decode_attention.py, bench_extend_attention.py) share: their
command line, the CUDA check and header line, and an even share of the time budget per case."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence

import torch
import triton


def parse_sweep_args(description: str, models: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """``--models`` (comma-separated, from ``models``), ``--repeats``, ``--budget-s``, ``--json``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", default=",".join(models))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=90.0, help="stop sweeping after this (shared by the cases)")
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    chosen = [m.strip() for m in options.models.split(",") if m.strip()]
    if any(m not in models for m in chosen):
        parser.error(f"--models from {sorted(models)}")
    return options, chosen


def require_cuda(tool: str) -> torch.cuda._CudaDeviceProperties:
    """The GPU's properties, after printing what runs where; exits naming ``tool`` without CUDA."""
    if not torch.cuda.is_available():
        sys.exit(f"{tool}: needs a CUDA device (it times CUDA graphs); none is available here")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    return props


def case_deadlines(count: int, budget_s: float) -> Iterator[float]:
    """A deadline (perf_counter) for each of ``count`` cases: an even share of what is left of the budget."""
    started = time.perf_counter()
    for index in range(count):
        left = budget_s - (time.perf_counter() - started)
        yield time.perf_counter() + max(0.0, left / (count - index))
