"""lab/tools/sweep_cli.py's variant loop (what the attention sweep tools share), driven by a launch
that writes a real output: errors against the default's output, skipped and failing launches,
the fastest accurate variant, the deadline."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from sweep_cli import case_deadlines, parse_sweep_args, sweep_variants


def test_variants_are_checked_timed_skipped_and_the_best_is_accurate() -> None:
    out = torch.zeros(4)
    ms_by_block = {64: 5.0, 32: 3.0, 128: 1.0, 16: 2.0}

    def launch(knobs: dict) -> float:
        if knobs["block"] == 16:
            raise RuntimeError("out of shared memory")
        out.copy_(torch.arange(4.0) + (1.0 if knobs["block"] == 128 else 0.0))  # 128 computes something else
        return ms_by_block[knobs["block"]]

    default = {"block": 64, "warps": 4}
    launch(default)
    variants, best = sweep_variants(
        default, [{"block": 64}, {"block": 32}, {"block": 128}, {"block": 16}, {"warps": 8}], time.perf_counter() + 60,
        launch, out, describe=lambda k: {**k, "label": f"b{k['block']}"}, figures=lambda ms: {"us": ms * 1e3},
        skip=lambda k: k["warps"] == 8)
    assert [v["label"] for v in variants] == ["b32", "b128", "b16"]  # the default itself and the skipped one not run
    assert variants[0]["rel_err"] == 0.0 and variants[1]["rel_err"] > 0.1
    assert variants[2]["error"] == "out of shared memory"
    assert best is not None and best["label"] == "b32"  # 128 is faster but wrong
    assert sweep_variants(default, [{"block": 32}], time.perf_counter() - 1, launch, out, describe=dict,
                          figures=lambda ms: {"us": ms}, skip=lambda k: False) == ([], None)  # past the deadline


def test_case_deadlines_share_the_budget_evenly() -> None:
    start = time.perf_counter()
    deadlines = list(case_deadlines(4, 8.0))
    assert len(deadlines) == 4
    assert abs(deadlines[0] - start - 2.0) < 0.5  # a quarter of the budget each when no time is spent


def test_cases_replace_the_tools_own_and_bad_ones_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    options, models = parse_sweep_args("t", ("1B", "8B"), ("batch", "context"), ["--cases", "24x1024, 48x576"])
    assert options.cases == [(24, 1024), (48, 576)] and models == ["1B", "8B"]
    assert parse_sweep_args("t", ("1B",), ("batch", "context"), [])[0].cases is None
    assert parse_sweep_args("t", ("1B",), (), [])[0].cases is None  # a tool without --cases
    for bad in ("24x", "24x1024x3", "ax1024"):
        with pytest.raises(SystemExit):
            parse_sweep_args("t", ("1B",), ("batch", "context"), ["--cases", bad])
        assert f"each case is batchxcontext (2 whole numbers joined by x), got '{bad}'" in capsys.readouterr().err
