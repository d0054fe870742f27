"""What the kernel sweep tools (bench_decode_attention.py, bench_extend_attention.py) share: their
command line, the CUDA check and header line, the loop over variants checked against the
default's output, and an even share of the time budget per case."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch


def parse_sweep_args(description: str, models: Sequence[str], case_fields: Sequence[str] = (),
                     argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """``--models`` (comma-separated, from ``models``), ``--repeats``, ``--budget-s``, ``--json``,
    and with ``case_fields`` (the names of a case's numbers, e.g. batch and context) ``--cases``:
    comma-separated cases of those numbers joined by ``x`` (``24x1024,48x1024``) that replace the
    tool's own for every model; ``options.cases`` is then a list of int tuples, else None."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", default=",".join(models))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=90.0, help="stop sweeping after this (shared by the cases)")
    parser.add_argument("--json", default=None)
    if case_fields:
        shape = "x".join(case_fields)
        parser.add_argument("--cases", default=None, type=lambda text: _cases(text, len(case_fields), shape),
                            help=f"cases to run instead of the tool's own, each {shape}, comma-separated")
    options = parser.parse_args(argv)
    if not case_fields:
        options.cases = None
    chosen = [m.strip() for m in options.models.split(",") if m.strip()]
    if any(m not in models for m in chosen):
        parser.error(f"--models from {sorted(models)}")
    return options, chosen


def _cases(text: str, fields: int, shape: str) -> list[tuple[int, ...]]:
    """``--cases`` parsed; argparse turns the ArgumentTypeError into a usage error naming it."""
    cases = []
    for item in (part.strip() for part in text.split(",")):
        numbers = item.split("x")
        if len(numbers) != fields or not all(n.isdigit() for n in numbers):
            raise argparse.ArgumentTypeError(f"each case is {shape} ({fields} whole numbers joined by x), got {item!r}")
        cases.append(tuple(int(n) for n in numbers))
    return cases


def require_cuda(tool: str) -> torch.cuda._CudaDeviceProperties:
    """The GPU's properties, after printing what runs where; exits naming ``tool`` without CUDA."""
    if not torch.cuda.is_available():
        sys.exit(f"{tool}: needs a CUDA device (it times CUDA graphs); none is available here")
    import triton  # here: importing triton early fixes whether its kernels are interpreted (tests import this module)

    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    return props


def sweep_variants(
    default: dict,
    changes: Sequence[dict],
    deadline: float,
    launch: Callable[[dict], float],
    out: torch.Tensor,
    *,
    describe: Callable[[dict], dict],
    figures: Callable[[float], dict],
    skip: Callable[[dict], bool],
) -> tuple[list[dict], dict | None]:
    """Time ``default`` updated by each of ``changes`` (``launch(knobs)``: ms, writing ``out``) until
    ``deadline``: every variant's figures and its relative error against the default's output,
    a launch that does not fit named instead; and the fastest variant within 2e-2 of it. The
    default must have been launched last (``out`` holds its output)."""
    reference = out.clone()
    variants = []
    for change in changes:
        knobs = {**default, **change}
        if time.perf_counter() > deadline:
            break
        if knobs == default or skip(knobs):
            continue
        try:
            ms = launch(knobs)
        except Exception as error:  # a launch that does not fit (shared memory, registers): named, skipped
            variants.append({**describe(knobs), "error": str(error)[:200]})
            continue
        err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
        variants.append({**describe(knobs), "rel_err": err, **figures(ms)})
    timed = [v for v in variants if "us" in v and v["rel_err"] < 2e-2]
    return variants, (min(timed, key=lambda v: v["us"]) if timed else None)


def case_deadlines(count: int, budget_s: float) -> Iterator[float]:
    """A deadline (perf_counter) for each of ``count`` cases: an even share of what is left of the budget."""
    started = time.perf_counter()
    for index in range(count):
        left = budget_s - (time.perf_counter() - started)
        yield time.perf_counter() + max(0.0, left / (count - index))
