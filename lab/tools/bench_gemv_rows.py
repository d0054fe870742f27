"""The persistent one-row gemv against the row-block kernel at the 1B's batch-1 kernels (GPU).

    python lab/tools/bench_gemv_rows.py [--repeats 15] [--budget-s 200] [--roles qkv,...] [--deep] [--json PATH]

The question (lab/notes/gpu_notes.md, lead 1 and variant 52): the row-block kernel (triton_gemv's
default grid) loses ~2-4 us a call against its bytes on the 1B's matrices while the lm_head,
30x longer, loses nothing: the kernel's ends, a ramp and a tail of thousands of short programs
finishing unevenly; with a prologue each of those programs also recomputes x. The persistent
kernel (app/kernels/triton_gemv_rows.py) runs a few programs an SM, each computing x once and
walking row tiles of the whole K in a pipelined loop.

Per role, as the model runs it with fused-decode (qkv with the norm prologue and the rotary
epilogue, gate_up with the norm and the SiLU epilogue, lm_head with the norm and the argmax,
o and down plain): the default config, rows_config's tiling, with ``--row-blocks`` the row-block
kernel's tilings for qkv, o and down, then the persistent kernel per (programs an
SM, rows a tile, warps, stages) (with ``--deep`` only one or two programs an SM of 8 warps at
4-6 stages: the launch that won for the fused MLP kernel, variant 85), each first checked
against the default config's output;
rows_config's choice is printed. Then the 1B's stack of plain linears (16 x qkv, o, gate_up, down, then
lm_head) in one graph, the default configs against the persistent one where it won. Timing as
lab/tools/bench_gemv.py (CUDA graphs of back-to-back calls over weight copies past the L2, median
of --repeats replays). No PDL anywhere: the persistent kernel never launches as a dependent.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for app

from app.kernels.triton_gemv import GemvConfig, RotaryStore, gemv, gemv_add_rms_norm, rows_config  # noqa: E402
from app.kernels.triton_greedy import empty_argmax_keys  # noqa: E402
from app.kernels.triton_rotary import cos_sin_tables  # noqa: E402
from bench_gemv import COPY_BW_TBS, MAX_REL_ERR, layer_shapes, rel_err, time_graph  # noqa: E402  (lab/tools/, this script's folder, is on sys.path)


def rows_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: tuple[int, int, int, int]) -> None:
    gemv(x, w, out=out, config=as_config(config, w.shape[1]))


def as_config(config: tuple[int, int, int, int], k: int) -> GemvConfig:
    per_sm, block_n, warps, stages = config
    return GemvConfig(block_n, triton.next_power_of_2(k), 1, False, warps, stages, programs_per_sm=per_sm)


def sweep(k: int, even: bool, deep: bool = False) -> list[tuple[int, int, int, int]]:
    """(programs an SM, rows a tile, warps, stages): tiles of 4-32 KB of bf16 (even rows for the
    rotary and SiLU epilogues); 8 warps only where x is long (K = 8192: 64 floats a thread at 4).
    ``deep``: one or two programs an SM of 8 warps, each with 3-5 tiles in flight instead (the
    fused MLP kernel's launch: one an SM at 4 stages ran 0.6 us a layer faster than two at 3)."""
    if deep:
        return [(per_sm, block_n, 8, stages) for block_n in (2, 4, 8) for per_sm in (1, 2) for stages in (4, 5, 6)
                if not (even and block_n % 2) and 4 <= block_n * k * 2 / 1024 <= 32
                and block_n * k * 2 / 1024 * stages * per_sm <= 200]
    configs = []
    for block_n in (2, 1, 4, 8):
        tile_kb = block_n * k * 2 / 1024
        if not 4 <= tile_kb <= 32 or (even and block_n % 2):
            continue
        for per_sm in (4, 2, 3):
            for stages in (3, 4, 2):
                for warps in ((4, 8) if k > 4096 else (4,)):
                    if tile_kb * stages * per_sm <= 200:  # shared memory of the pipelined tiles
                        configs.append((per_sm, block_n, warps, stages))
    return configs


def row_block_sweep(k: int, even: bool) -> list[GemvConfig]:
    """Row-block (non-persistent) FMA tilings for the roles that stay on that kernel (qkv, o,
    down): rows a program, K a step, stages, warps; tiles of 2-16 KB of bf16 (even rows for the
    rotary epilogue). The default grid of such a config still covers N with one K slice."""
    configs = []
    for block_n in (4, 2, 8):
        if even and block_n % 2:
            continue
        for block_k in (1024, 2048, 512):
            if block_k > triton.next_power_of_2(k) or not 2 <= block_n * block_k * 2 / 1024 <= 16:
                continue
            for stages in (1, 2, 3):
                for warps in ((4, 8) if block_n * block_k >= 8192 else (4,)):
                    configs.append(GemvConfig(block_n, block_k, 1, False, warps, stages))
    return configs


def label(config: tuple[int, int, int, int]) -> str:
    per_sm, block_n, warps, stages = config
    return f"rows {per_sm}/SM {block_n}xK w{warps} p{stages}"


def role_kernel(layer: str, n: int, k: int, device: torch.device):
    """The batch-1 decode kernel of a role as the model runs it (fused-decode defaults): qkv with
    the norm prologue and the rotary epilogue, gate_up with the norm prologue and the SiLU
    epilogue, lm_head with the norm prologue and the argmax epilogue, o and down plain. Returns
    ``run(weight, config | None)`` and ``result()`` (what it wrote, to compare configs)."""
    dtype = torch.bfloat16
    x, residual = (torch.randn((1, k), device=device, dtype=dtype) for _ in range(2))
    norm_weight = 1 + 0.1 * torch.randn(k, device=device, dtype=dtype)
    residual_out = torch.empty_like(x)
    out = torch.empty((1, n // 2 if layer == "gate_up" else n), device=device, dtype=dtype)
    if layer == "qkv":  # the 1B: 32 q heads, 8 kv heads of 64
        q_heads, kv_heads, head_dim = 32, 8, 64
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
        cos, sin = cos_sin_tables(inv_freq, 2048)
        k_cache, v_cache = (torch.zeros((64, kv_heads, head_dim), device=device, dtype=dtype) for _ in range(2))
        rot = RotaryStore(cos, sin, torch.tensor([700], device=device), torch.tensor([9], device=device),
                          k_cache, v_cache, q_heads)

        def run(w, config):
            gemv_add_rms_norm(x, residual, norm_weight, 1e-5, w, config=config, out=out, residual_out=residual_out,
                              rotary=rot)

        def result():
            return torch.cat([out[0, : q_heads * head_dim], k_cache[9].flatten(), v_cache[9].flatten()])
        return run, result
    if layer in ("gate_up", "lm_head"):
        keys = empty_argmax_keys(1, device) if layer == "lm_head" else None

        def run(w, config):
            gemv_add_rms_norm(x, residual, norm_weight, 1e-5, w, config=config, out=out, residual_out=residual_out,
                              silu_mul=layer == "gate_up", argmax_keys=keys)
        return run, lambda: out[0]

    def run(w, config):
        gemv(x, w, config=config, out=out)
    return run, lambda: out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="sweep for this many seconds, an equal share a shape")
    parser.add_argument("--json", default=None)
    parser.add_argument("--roles", default="qkv,o,gate_up,down,lm_head",
                        help="the roles to sweep, comma-separated (the stack runs only with all five)")
    parser.add_argument("--deep", action="store_true",
                        help="sweep one or two programs an SM of 8 warps at 4-6 stages instead (the fused MLP's "
                             "launch)")
    parser.add_argument("--row-blocks", action="store_true",
                        help="also sweep the row-block kernel's tilings for qkv, o and down")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemv_rows: needs a CUDA device")
    started = time.perf_counter()
    device = torch.device("cuda")
    torch.manual_seed(0)
    shapes = layer_shapes("1B")
    results: dict[str, list[dict]] = {}
    best: dict[str, tuple[int, int, int, int]] = {}
    roles = [role for role in ("qkv", "o", "gate_up", "down", "lm_head") if role in options.roles.split(",")]
    for number, layer in enumerate(roles):
        layer_deadline = started + options.budget_s * (number + 1) / len(roles)  # an equal share a shape
        n, k = shapes[layer]
        w = torch.randn((n, k), device=device, dtype=torch.bfloat16) / math.sqrt(k)
        weights = [w] + [w.clone() for _ in range(max(0, min(63, math.ceil(512 * 2**20 / (w.numel() * 2)) - 1)))]
        run, result = role_kernel(layer, n, k, device)
        run(w, None)
        reference = result().float().clone()
        calls = max(20, len(weights))
        nbytes = w.numel() * 2

        def timed(config) -> dict:
            def graph_calls() -> None:
                for i in range(calls):
                    run(weights[i % len(weights)], config)
            us = time_graph(graph_calls, options.repeats) / calls * 1e3
            return {"us": round(us, 2), "pct": round(100 * nbytes / (us * 1e-6) / (COPY_BW_TBS * 1e12), 1)}

        def measured(entry: dict, config: GemvConfig) -> dict:
            """``entry`` with the config's figures, or the reason it has none (checked against the default's output)."""
            try:
                run(weights[0], config)  # (the first copy is w)
                err = rel_err(result(), reference)
                if err > MAX_REL_ERR:
                    entry["error"] = f"rel err {err:.1e} against the default config"
                else:
                    entry.update(timed(config))
            except Exception as exc:  # a config triton cannot build (registers, shared memory) is reported
                entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
            shown = entry.get("error") or f"{entry['us']:7.2f} us {entry['pct']:5.1f}%"
            print(f"{layer:8s} {entry['label']:28s} {shown}", flush=True)
            return entry

        rows = [{"label": "default config", **timed(None)}]
        print(f"{layer:8s} {rows[0]['label']:28s} {rows[0]['us']:7.2f} us {rows[0]['pct']:5.1f}%", flush=True)
        rules = rows_config(n, k, even=layer in ("qkv", "gate_up"))
        if rules is not None:  # the rule's tiling
            rows.append(measured({"label": rules.label(), "rule": True}, rules))
        if options.row_blocks and layer in ("qkv", "o", "down"):
            for config in row_block_sweep(k, even=layer == "qkv"):
                if time.perf_counter() > layer_deadline:
                    print(f"{layer}: budget reached", flush=True)
                    break
                rows.append(measured({"label": config.label(), "row_block": True}, config))
        for config in sweep(k, even=layer in ("qkv", "gate_up"), deep=options.deep):
            if time.perf_counter() > layer_deadline:
                print(f"{layer}: budget reached", flush=True)
                break
            rows.append(measured({"label": label(config), "config": config}, as_config(config, k)))
        timed_rows = [r for r in rows[1:] if "us" in r and "config" in r]
        if timed_rows and min(r["us"] for r in timed_rows) < rows[0]["us"]:  # the stack uses it where it won
            best[layer] = min(timed_rows, key=lambda r: r["us"])["config"]
        print(f"{layer:8s} rows_config's: {rules.label() if rules else None}", flush=True)
        results[layer] = rows
        weights.clear()
        del w
        torch.cuda.empty_cache()

    if len(roles) < 5:
        if options.json:
            Path(options.json).write_text(json.dumps({"shapes": results}, indent=1))
        return
    # The whole stack of plain linears, the default configs against the best persistent one where it won.
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
                rows_gemv(xs[name], w, outs[name], best[name])
            else:
                gemv(xs[name], w, out=outs[name])
        return calls

    figures = {}
    for key, use_rows in (("default", False), ("rows", True), ("default again", False), ("rows again", True)):
        ms = time_graph(stack(use_rows), options.repeats)
        figures[key] = {"ms": round(ms, 4), "pct": round(100 * total / (ms * 1e-3) / (COPY_BW_TBS * 1e12), 1)}
        print(f"1B stack {key:14s} {ms:.4f} ms {figures[key]['pct']:5.1f}% of copy BW", flush=True)
    print("persistent configs that won: " + (", ".join(f"{k}: {label(v)}" for k, v in best.items()) or "none"))
    if options.json:
        Path(options.json).write_text(json.dumps({"shapes": results, "stack": figures,
                                                  "best": {k: list(v) for k, v in best.items()}}, indent=1))


if __name__ == "__main__":
    main()
