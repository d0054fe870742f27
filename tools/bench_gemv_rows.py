"""A persistent row-tile gemv against our default gemv at the 1B's one-row shapes (GPU).

    python tools/bench_gemv_rows.py [--repeats 15] [--budget-s 200] [--json PATH]

The question (docs/gpu_notes.md, lead 1): our default gemv loses ~2-4 us a call against its
bytes on the 1B's matrices (gate_up 19.1 us against 15.9 at the copy bandwidth) while the
lm_head, 30x longer, loses nothing: a per-kernel cost, the ramp at the start and the tail at the
end, where thousands of short programs (two K steps each) finish unevenly. The persistent
variant launches a fixed number of programs per SM; each holds x (all of K) in registers and
walks row tiles ``pid, pid + P, ...`` of the whole K, the tile loop software-pipelined
(``num_stages`` tiles in flight a program), so every program streams the same bytes and
finishes with the others, and the first tiles of the next row block are already on their way
while one is reduced.

Per shape: our default gemv (no PDL), the persistent kernel per (programs an SM, rows a tile,
warps, stages), each checked against a float32 product first; then the whole 1B stack of
linears (16 x qkv, o, gate_up, down, then lm_head) in one graph with the default gemv and with
the best persistent config per shape. Timing as tools/bench_gemv.py (CUDA graphs of back-to-
back calls over weight copies past the L2, median of --repeats replays).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.triton_gemv import gemv  # noqa: E402
from tools.bench_gemv import COPY_BW_TBS, MAX_REL_ERR, layer_shapes, rel_err, time_graph  # noqa: E402


@triton.jit
def _rows_kernel(x_ptr, w_ptr, out_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, K)
    x = tl.load(x_ptr + cols).to(tl.float32)
    idx = tl.arange(0, BLOCK_N)
    tiles = tl.cdiv(N, BLOCK_N)
    for t in tl.range(pid, tiles, programs, num_stages=NUM_STAGES):
        rows = t * BLOCK_N + idx
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=(rows < N)[:, None], other=0.0)
        y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


def rows_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: tuple[int, int, int, int],
              num_sms: int) -> None:
    per_sm, block_n, warps, stages = config
    n, k = w.shape
    grid = (min(num_sms * per_sm, triton.cdiv(n, block_n)),)
    _rows_kernel[grid](x, w, out, n, K=k, BLOCK_N=block_n, NUM_STAGES=stages, num_warps=warps)


def sweep(k: int) -> list[tuple[int, int, int, int]]:
    """(programs an SM, rows a tile, warps, stages): tiles of 4-32 KB of bf16."""
    configs = []
    for block_n in (1, 2, 4, 8):
        tile_kb = block_n * k * 2 / 1024
        if not 4 <= tile_kb <= 32:
            continue
        for per_sm in (2, 4, 1):
            for warps in (4, 8):
                for stages in (3, 2):
                    if tile_kb * stages * per_sm <= 160:  # shared memory of the pipelined tiles
                        configs.append((per_sm, block_n, warps, stages))
    return configs


def label(config: tuple[int, int, int, int]) -> str:
    per_sm, block_n, warps, stages = config
    return f"rows {per_sm}/SM {block_n}xK w{warps} p{stages}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="sweep for this many seconds, an equal share a shape")
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemv_rows: needs a CUDA device")
    started = time.perf_counter()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    shapes = layer_shapes("1B")
    results: dict[str, list[dict]] = {}
    best: dict[str, tuple[int, int, int, int]] = {}
    for number, layer in enumerate(("qkv", "o", "gate_up", "down", "lm_head")):
        layer_deadline = started + options.budget_s * (number + 1) / 5  # an equal share a shape
        n, k = shapes[layer]
        w = torch.randn((n, k), device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
        weights = [w] + [w.clone() for _ in range(max(0, min(63, math.ceil(512 * 2**20 / (w.numel() * 2)) - 1)))]
        x = torch.randn((1, k), device="cuda", dtype=torch.bfloat16)
        out = torch.empty((1, n), device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w.float().t()
        calls = max(20, len(weights))
        nbytes = w.numel() * 2

        def timed(run) -> dict:
            def graph_calls() -> None:
                for i in range(calls):
                    run(weights[i % len(weights)])
            us = time_graph(graph_calls, options.repeats) / calls * 1e3
            return {"us": round(us, 2), "pct": round(100 * nbytes / (us * 1e-6) / (COPY_BW_TBS * 1e12), 1)}

        rows = [{"label": "default gemv", **timed(lambda wt: gemv(x, wt, out=out))}]
        print(f"{layer:8s} {rows[0]['label']:28s} {rows[0]['us']:7.2f} us {rows[0]['pct']:5.1f}%", flush=True)
        for config in sweep(k):
            if time.perf_counter() > layer_deadline:
                print(f"{layer}: budget reached", flush=True)
                break
            entry: dict = {"label": label(config), "config": config}
            try:
                rows_gemv(x, w, out, config, num_sms)
                err = rel_err(out, ref)
                if err > MAX_REL_ERR:
                    entry["error"] = f"rel err {err:.1e}"
                else:
                    entry.update(timed(lambda wt: rows_gemv(x, wt, out, config, num_sms)))
            except Exception as exc:  # a config triton cannot build (registers, shared memory) is reported
                entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
            rows.append(entry)
            shown = entry.get("error") or f"{entry['us']:7.2f} us {entry['pct']:5.1f}%"
            print(f"{layer:8s} {entry['label']:28s} {shown}", flush=True)
        timed_rows = [r for r in rows[1:] if "us" in r]
        if timed_rows:
            best[layer] = min(timed_rows, key=lambda r: r["us"])["config"]
        results[layer] = rows
        weights.clear()
        del w
        torch.cuda.empty_cache()

    # The whole stack of linears, default against the best persistent config per shape.
    layers = 16
    weights = {name: [torch.randn(shapes[name], device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
               for name in ("qkv", "o", "gate_up", "down")}
    weights["lm_head"] = [torch.randn(shapes["lm_head"], device="cuda", dtype=torch.bfloat16)]
    total = sum(w.numel() * 2 for ws in weights.values() for w in ws)
    xs = {name: torch.randn((1, shapes[name][1]), device="cuda", dtype=torch.bfloat16) for name in weights}
    outs = {name: torch.empty((1, shapes[name][0]), device="cuda", dtype=torch.bfloat16) for name in weights}

    def stack(use_rows: bool):
        def calls() -> None:
            for i in range(layers):
                for name in ("qkv", "o", "gate_up", "down"):
                    linear(name, weights[name][i])
            linear("lm_head", weights["lm_head"][0])

        def linear(name: str, w: torch.Tensor) -> None:
            if use_rows and name in best:
                rows_gemv(xs[name], w, outs[name], best[name], num_sms)
            else:
                gemv(xs[name], w, out=outs[name])
        return calls

    figures = {}
    for key, use_rows in (("default", False), ("rows", True), ("default again", False), ("rows again", True)):
        ms = time_graph(stack(use_rows), options.repeats)
        figures[key] = {"ms": round(ms, 4), "pct": round(100 * total / (ms * 1e-3) / (COPY_BW_TBS * 1e12), 1)}
        print(f"1B stack {key:14s} {ms:.4f} ms {figures[key]['pct']:5.1f}% of copy BW", flush=True)
    print("best persistent configs: " + ", ".join(f"{k}: {label(v)}" for k, v in best.items()))
    if options.json:
        Path(options.json).write_text(json.dumps({"shapes": results, "stack": figures,
                                                  "best": {k: list(v) for k, v in best.items()}}, indent=1))


if __name__ == "__main__":
    main()
