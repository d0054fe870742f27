"""Decode-shaped linears on the GPU: our triton gemv against F.linear (cuBLAS), in CUDA graphs.

    python lab/tools/bench_gemv.py [--models 1B,8B] [--ms 1,4,16] [--no-sweep] [--budget-s 130]
                                   [--repeats 15] [--rotate-mb 512] [--json PATH] [--epilogues]

For the Llama-3.2-1B and Llama-3.1-8B linear shapes (qkv, o, gate_up, down, lm_head) at
M = 1, 4, 16 in bf16: each variant is captured in one CUDA graph of back-to-back calls that
rotate over enough weight copies (>= --rotate-mb in all, so no weight is still in the 50 MB L2
when it is read again), replayed --repeats times between CUDA events; figures are the median
per call. GB/s is weight bytes / time, and % is of the H200's measured copy bandwidth
(4.23 TB/s). Every config is first checked against a float32 product (relative error), and one
that is off is not timed.

Order of work, so that the essentials finish first: F.linear and the default config for every
shape; the whole 1B decode stack (16 layers x qkv, o, gate_up, down + lm_head at M = 1, one
graph per step) with F.linear and with gemv, and (compute capability 9.0+) with the gemv
launched as programmatic dependents in each of PDL_MODES; then the config sweep until --budget-s has passed
(M = 1 first); then the stack again with the best swept config per shape. The last lines printed
are a summary table; --json writes every figure. ``--epilogues`` times only the 1B's batch-1
kernels with a prologue and an epilogue (lm_head with the argmax, gate_up with the SiLU) per tiling.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for app

from app.kernels.triton_gemv import (  # noqa: E402
    FMA_MAX_M,
    PDL_MODES,
    GemvConfig,
    default_config,
    effective_split,
    gemv,
    gemv_add_rms_norm,
    split_for,
)
from app.kernels.triton_greedy import ARGMAX_SLOTS  # noqa: E402

COPY_BW_TBS = 4.23  # H200 device-to-device copy bandwidth measured on the lent machine, TB/s
MAX_REL_ERR = 1e-2  # against a float32 product; bf16 output rounding alone is ~3e-3
MODELS = {
    # hidden, q+k+v out, intermediate, vocab, layers
    "1B": dict(hidden=2048, qkv=3072, inter=8192, vocab=128256, layers=16),
    "8B": dict(hidden=4096, qkv=6144, inter=14336, vocab=128256, layers=32),
}
LAYERS = ("qkv", "o", "gate_up", "down", "lm_head")
# (block_n, block_k, num_warps, num_stages) swept around the heuristic; split-K per split_for.
FMA_SWEEP_M1 = [(1, 1024, 4, 1), (2, 1024, 4, 1), (4, 1024, 4, 1), (8, 1024, 4, 1), (8, 512, 4, 1),
                (16, 256, 4, 1), (4, 2048, 8, 1), (8, 1024, 8, 1), (2, 1024, 4, 2), (4, 1024, 4, 2),
                (4, 1024, 4, 3), (8, 512, 4, 2)]
FMA_SWEEP_M4 = [(2, 1024, 4, 1), (4, 1024, 4, 1), (4, 512, 4, 1), (2, 1024, 4, 2)]
DOT_SWEEP = [(16, 256, 4, 3), (16, 128, 4, 4), (16, 512, 4, 3), (32, 256, 4, 3), (16, 256, 8, 3),
             (16, 256, 4, 2), (32, 128, 4, 4), (64, 128, 4, 3), (16, 256, 4, 4)]


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """layer -> (N, K) of its weight."""
    c = MODELS[model]
    return {"qkv": (c["qkv"], c["hidden"]), "o": (c["hidden"], c["hidden"]), "gate_up": (2 * c["inter"], c["hidden"]),
            "down": (c["hidden"], c["inter"]), "lm_head": (c["vocab"], c["hidden"])}


def sweep_configs(m: int, n: int, k: int, num_sms: int) -> list[GemvConfig]:
    """Configs to time beyond the default: other tiles (each with split_for's split) and the
    default tile with other splits."""
    base = default_config(m, n, k, num_sms)
    tiles = []
    if m <= FMA_MAX_M:
        tiles += [(t, False) for t in (FMA_SWEEP_M1 if m <= 2 else FMA_SWEEP_M4)]
    tiles += [(t, True) for t in (DOT_SWEEP if m > 1 else DOT_SWEEP[:1])]
    configs = []
    for (block_n, block_k, warps, stages), dot in tiles:
        split = split_for(n, k, block_n, block_k, num_sms)
        configs.append(GemvConfig(block_n, block_k, split, dot, warps, stages))
    for split in (1, 2, 4, 8):
        if effective_split(k, base.block_k, split)[0] == split:
            configs.append(base._replace(split_k=split))
    unique = []
    for config in configs:
        if config != base and config not in unique:
            unique.append(config)
    return unique


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def time_graph(calls: Callable[[], None], repeats: int) -> float:
    """Median ms of one replay of a CUDA graph of ``calls`` (run once eagerly first)."""
    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(start.elapsed_time(end) for start, end in events)
    del graph
    return ms


class Case:
    """One (model, layer, M): its weight copies, input, float32 reference and results."""

    def __init__(self, model: str, layer: str, m: int, weights: list[torch.Tensor], num_sms: int) -> None:
        self.model, self.layer, self.m = model, layer, m
        self.weights = weights
        self.n, self.k = weights[0].shape
        self.weight_bytes = weights[0].numel() * weights[0].element_size()
        self.calls = max(20, len(weights))
        self.x = torch.randn((m, self.k), device="cuda", dtype=weights[0].dtype)
        self.default = default_config(m, self.n, self.k, num_sms)
        self.flinear: dict | None = None
        self.results: list[dict] = []  # one per gemv config
        self._reference: torch.Tensor | None = None

    def reference(self) -> torch.Tensor:
        """x @ W^T of the first weight copy in float32 (the others are clones)."""
        if self._reference is None:
            self._reference = self.x.float() @ self.weights[0].float().T
        return self._reference

    def figures(self, ms_per_call: float) -> dict:
        gbps = self.weight_bytes / (ms_per_call * 1e-3) / 1e9
        return {"us": ms_per_call * 1e3, "gbps": gbps, "pct": 100 * gbps / (COPY_BW_TBS * 1e3)}

    def run_flinear(self, repeats: int) -> None:
        err = rel_err(F.linear(self.x, self.weights[0]), self.reference())

        def calls() -> None:
            for i in range(self.calls):
                F.linear(self.x, self.weights[i % len(self.weights)])

        self.flinear = {"rel_err": err, **self.figures(time_graph(calls, repeats) / self.calls)}

    def run_gemv(self, config: GemvConfig, repeats: int) -> dict:
        entry: dict = {"config": config._asdict(), "label": config.label(), "default": config == self.default}
        try:
            entry["rel_err"] = rel_err(gemv(self.x, self.weights[0], config=config), self.reference())
            if not entry["rel_err"] <= MAX_REL_ERR:
                entry["error"] = f"wrong result: relative error {entry['rel_err']:.3g}"
            else:
                def calls() -> None:
                    for i in range(self.calls):
                        gemv(self.x, self.weights[i % len(self.weights)], config=config)

                entry.update(self.figures(time_graph(calls, repeats) / self.calls))
        except Exception as exc:  # a config that fails to compile or launch is reported, not fatal
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        self.results.append(entry)
        return entry

    def best(self) -> dict | None:
        timed = [r for r in self.results if "gbps" in r]
        return max(timed, key=lambda r: r["gbps"]) if timed else None

    def name(self) -> str:
        return f"{self.model:3s} {self.layer:8s} {self.n:>6d}x{self.k:<5d} M={self.m:<2d}"

    def to_json(self) -> dict:
        return {"model": self.model, "layer": self.layer, "n": self.n, "k": self.k, "m": self.m,
                "weight_bytes": self.weight_bytes, "weight_copies": len(self.weights), "calls_per_graph": self.calls,
                "default": self.default._asdict(), "flinear": self.flinear, "gemv": self.results}


def describe(entry: dict) -> str:
    if "error" in entry:
        return f"{entry['label']:28s} {entry['error']}"
    return (f"{entry['label']:28s} {entry['us']:8.1f} us {entry['gbps']:7.0f} GB/s {entry['pct']:5.1f}%"
            f"  err {entry['rel_err']:.1e}")


def stack_step(weights: dict[str, list[torch.Tensor]], x_hidden: torch.Tensor, x_inter: torch.Tensor,
               linear: Callable[[str, torch.Tensor, torch.Tensor], None]) -> Callable[[], None]:
    """One decode step's linears: every layer's qkv, o, gate_up, down, then lm_head."""
    def calls() -> None:
        for i in range(len(weights["qkv"])):
            linear("qkv", x_hidden, weights["qkv"][i])
            linear("o", x_hidden, weights["o"][i])
            linear("gate_up", x_hidden, weights["gate_up"][i])
            linear("down", x_inter, weights["down"][i])
        linear("lm_head", x_hidden, weights["lm_head"][0])
    return calls


def run_stack(configs: dict[str, GemvConfig] | None, repeats: int, pdl: bool | str = False) -> dict:
    """The 1B model's decode-step linears at M = 1 in one graph; F.linear when configs is None.
    ``pdl``: the gemv launches as programmatic dependents (a mode of PDL_MODES)."""
    c = MODELS["1B"]
    shapes = layer_shapes("1B")
    dtype = torch.bfloat16
    weights = {name: [torch.randn(shapes[name], device="cuda", dtype=dtype) for _ in range(c["layers"])]
               for name in ("qkv", "o", "gate_up", "down")}  # each layer its own weights
    weights["lm_head"] = [torch.randn(shapes["lm_head"], device="cuda", dtype=dtype)]
    total_bytes = sum(w.numel() * w.element_size() for ws in weights.values() for w in ws)
    x_hidden = torch.randn((1, c["hidden"]), device="cuda", dtype=dtype)
    x_inter = torch.randn((1, c["inter"]), device="cuda", dtype=dtype)

    def linear(name: str, x: torch.Tensor, w: torch.Tensor) -> None:
        if configs is None:
            F.linear(x, w)
        else:
            gemv(x, w, config=configs.get(name), pdl=pdl)

    ms = time_graph(stack_step(weights, x_hidden, x_inter, linear), repeats)
    del weights
    torch.cuda.empty_cache()
    gbps = total_bytes / (ms * 1e-3) / 1e9
    return {"ms": ms, "tok_s": 1e3 / ms, "gbps": gbps, "pct": 100 * gbps / (COPY_BW_TBS * 1e3), "bytes": total_bytes}


# (block_n, block_k, num_warps, num_stages) for the epilogue kernels: the M = 1 default first, then
# tilings with more rows per program (fewer programs to pay the prologue's and epilogue's fixed work).
EPILOGUE_SWEEP = [(4, 1024, 4, 1), (2, 1024, 4, 1), (8, 512, 4, 1), (16, 256, 4, 1), (32, 128, 4, 1),
                  (8, 1024, 8, 1), (16, 512, 8, 1)]


def run_epilogues(repeats: int) -> list[dict]:
    """The 1B's batch-1 kernels that carry more than a product, per tiling: lm_head with the norm
    prologue and the argmax epilogue (fused-greedy), gate_up with the norm prologue and the
    SiLU epilogue (fused-silu-out); against the plain gemv's default on the same weights (what
    the prologue and epilogue cost, and which tiling amortises them)."""
    c = MODELS["1B"]
    shapes = layer_shapes("1B")
    dtype = torch.bfloat16
    hidden = c["hidden"]
    x, residual = (torch.randn((1, hidden), device="cuda", dtype=dtype) for _ in range(2))
    norm_weight = 1 + 0.1 * torch.randn(hidden, device="cuda", dtype=dtype)
    residual_out = torch.empty_like(x)
    keys = torch.zeros((1, ARGMAX_SLOTS), device="cuda", dtype=torch.int64)
    rows: list[dict] = []
    for layer, extra in (("lm_head", dict(argmax_keys=keys)), ("gate_up", dict(silu_mul=True))):
        n, k = shapes[layer]
        w = torch.randn((n, k), device="cuda", dtype=dtype) / math.sqrt(k)
        weights = [w] + [w.clone() for _ in range(max(0, math.ceil(512 * 2**20 / (w.numel() * 2)) - 1))]
        calls = max(8, len(weights))
        weight_bytes = w.numel() * w.element_size()

        def timed(run: Callable[[torch.Tensor], None]) -> dict:
            def graph_calls() -> None:
                for i in range(calls):
                    run(weights[i % len(weights)])
            us = time_graph(graph_calls, repeats) / calls * 1e3
            return {"us": us, "pct": 100 * weight_bytes / (us * 1e-6) / (COPY_BW_TBS * 1e12)}

        plain = {"layer": layer, "label": "plain gemv, default", **timed(lambda wt: gemv(x, wt))}
        rows.append(plain)
        print(f"1B {layer:8s} {plain['label']:34s} {plain['us']:8.1f} us {plain['pct']:5.1f}%", flush=True)
        for block_n, block_k, warps, stages in EPILOGUE_SWEEP:
            config = GemvConfig(block_n, block_k, 1, False, warps, stages)
            entry: dict = {"layer": layer, "label": f"with epilogue, {config.label()}", "config": config._asdict()}
            try:
                entry.update(timed(lambda wt: gemv_add_rms_norm(x, residual, norm_weight, 1e-5, wt, config=config,
                                                                residual_out=residual_out, **extra)))
                line = f"{entry['us']:8.1f} us {entry['pct']:5.1f}%"
            except Exception as exc:  # a tiling the epilogue cannot take is reported, not fatal
                entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                line = entry["error"]
            rows.append(entry)
            print(f"1B {layer:8s} {entry['label']:34s} {line}", flush=True)
        weights.clear()  # the copies go before the next layer allocates its own
        del w
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="1B,8B", help="comma-separated: 1B, 8B")
    parser.add_argument("--ms", default="1,4,16", help="comma-separated batch sizes M (1..16)")
    parser.add_argument("--no-sweep", action="store_true", help="only F.linear and the default config")
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="time no more swept configs after this many seconds (keeps the run under 3 min)")
    parser.add_argument("--repeats", type=int, default=15, help="timed graph replays per figure (median)")
    parser.add_argument("--rotate-mb", type=int, default=512, help="weight copies per shape add up to at least this")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    parser.add_argument("--epilogues", action="store_true",
                        help="only the 1B's lm_head (norm + argmax) and gate_up (norm + SiLU) kernels per tiling")
    options = parser.parse_args()
    models = [s.strip() for s in options.models.split(",") if s.strip()]
    ms_list = [int(s) for s in options.ms.split(",") if s.strip()]
    if any(m not in MODELS for m in models) or any(not 1 <= m <= 16 for m in ms_list):
        parser.error(f"--models from {sorted(MODELS)}, --ms from 1..16")
    if not torch.cuda.is_available():
        sys.exit("bench_gemv: needs a CUDA device (it times CUDA graphs); none is available here")

    started = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    header = (f"{props.name}, {num_sms} SMs, torch {torch.__version__}, triton {triton.__version__}; "
              f"% of {COPY_BW_TBS} TB/s copy bandwidth")
    print(header, flush=True)
    torch.manual_seed(0)
    if options.epilogues:
        rows = run_epilogues(options.repeats)
        if options.json:
            Path(options.json).write_text(json.dumps({"device": props.name, "epilogues_1b": rows}, indent=1))
        return

    weight_cache: dict[tuple[str, str], list[torch.Tensor]] = {}
    cases: list[Case] = []
    for model in models:
        for layer, (n, k) in layer_shapes(model).items():
            w = torch.randn((n, k), device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
            copies = max(1, min(64, math.ceil(options.rotate_mb * 2**20 / (w.numel() * w.element_size()))))
            weight_cache[(model, layer)] = [w] + [w.clone() for _ in range(copies - 1)]
            for m in ms_list:
                cases.append(Case(model, layer, m, weight_cache[(model, layer)], num_sms))

    print("\n-- F.linear and the default config --", flush=True)
    for case in cases:
        case.run_flinear(options.repeats)
        entry = case.run_gemv(case.default, options.repeats)
        fl = case.flinear
        print(f"{case.name()} F.linear {fl['us']:8.1f} us {fl['gbps']:7.0f} GB/s {fl['pct']:5.1f}% | "
              f"default {describe(entry)}", flush=True)

    stack: dict = {}
    if "1B" in models:
        print("\n-- whole 1B decode stack at M = 1 --", flush=True)
        stack["flinear"] = run_stack(None, options.repeats)
        stack["gemv_default"] = run_stack({}, options.repeats)
        if torch.cuda.get_device_capability(0) >= (9, 0):  # programmatic dependent launch: Hopper+
            for mode in PDL_MODES:
                stack[f"gemv_pdl_{mode}"] = run_stack({}, options.repeats, pdl=mode)
        for key, fig in stack.items():
            print(f"{key:14s} {fig['ms']:.3f} ms/step {fig['tok_s']:7.0f} tok/s {fig['pct']:5.1f}%", flush=True)

    swept: list[Case] = []
    if not options.no_sweep:
        print(f"\n-- sweep (until {options.budget_s:.0f} s) --", flush=True)
        for case in sorted(cases, key=lambda c: ms_list.index(c.m)):  # M = 1 first
            configs = sweep_configs(case.m, case.n, case.k, num_sms)
            done = 0
            while done < len(configs) and time.perf_counter() - started <= options.budget_s:
                print(f"{case.name()} {describe(case.run_gemv(configs[done], options.repeats))}", flush=True)
                done += 1
            if done < len(configs):
                print(f"budget reached: {case.name()} swept {done} of {len(configs)}, "
                      f"{len(cases) - len(swept) - 1} more shapes not swept", flush=True)
                break
            swept.append(case)
        tuned = {c.layer: c.best() for c in swept if c.model == "1B" and c.m == 1}
        if all(tuned.get(layer) for layer in LAYERS):
            best_configs = {layer: GemvConfig(**tuned[layer]["config"]) for layer in LAYERS}
            stack["gemv_tuned"] = run_stack(best_configs, options.repeats)
            stack["gemv_tuned"]["configs"] = {layer: cfg.label() for layer, cfg in best_configs.items()}

    weight_cache.clear()
    elapsed = time.perf_counter() - started
    print_summary(header, cases, stack, elapsed)
    if options.json:
        Path(options.json).write_text(json.dumps({
            "device": props.name, "num_sms": num_sms, "torch": torch.__version__, "triton": triton.__version__,
            "copy_bw_tbs": COPY_BW_TBS, "elapsed_s": elapsed, "cases": [c.to_json() for c in cases], "stack_1b": stack,
        }, indent=1))
        print(f"figures written to {options.json}")


def summary_cell(entry: dict | None, flinear_gbps: float) -> str:
    """``GB/s  % xratio`` of a gemv result (16 characters), ERR when it failed, - when absent."""
    if entry is None or "gbps" not in entry:
        return f"{'ERR' if entry else '-':16s}"
    return f"{entry['gbps']:5.0f} {entry['pct']:3.0f}% x{entry['gbps'] / flinear_gbps:4.2f}"


def print_summary(header: str, cases: list[Case], stack: dict, elapsed: float) -> None:
    print(f"\n== summary: {header}; {elapsed:.0f} s ==")
    print("GB/s = weight bytes / time per call (median, CUDA graph, weights rotated past L2); x = gemv / F.linear")
    print(f"{'model layer    N x K     M':30s} | {'F.linear':15s} | {'gemv default':16s} {'config':22s} | "
          f"{'best swept':16s} config")
    for case in cases:
        fl = case.flinear["gbps"]
        default = next((r for r in case.results if r["default"]), None)
        best = case.best() if len(case.results) > 1 else None
        print(f"{case.name():30s} | {fl:5.0f} GB/s {case.flinear['pct']:3.0f}% | {summary_cell(default, fl)} "
              f"{case.default.label():22s} | {summary_cell(best, fl)} {best['label'] if best else ''}")
    failed = [(c, r) for c in cases for r in c.results if "error" in r]
    if failed:
        case, entry = failed[0]
        print(f"{len(failed)} configs failed; first: {case.name()} {entry['label']}: {entry['error']}")
    for key, fig in stack.items():
        extra = f"  ({', '.join(f'{k}: {v}' for k, v in fig['configs'].items())})" if "configs" in fig else ""
        print(f"1B stack M=1 {key:13s} {fig['ms']:.3f} ms/step {fig['tok_s']:6.0f} tok/s "
              f"{fig['pct']:3.0f}% of copy BW{extra}")
    if stack:
        ideal_ms = next(iter(stack.values()))["bytes"] / (COPY_BW_TBS * 1e12) * 1e3
        print(f"1B stack at {COPY_BW_TBS} TB/s: {ideal_ms:.3f} ms/step, {1e3 / ideal_ms:.0f} tok/s "
              "(linears only: no attention, norms or sampling)")


if __name__ == "__main__":
    main()
