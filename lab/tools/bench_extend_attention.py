"""Our triton extend (prefill) attention on the GPU: its launch knobs swept at the prefill shapes that matter.

    python lab/tools/bench_extend_attention.py [--models 1B,8B] [--repeats 10] [--budget-s 90] [--json PATH]

Why: in the 256 x (512 -> 128) benchmark each prefill step (16 prompts of 512 tokens) spends
1.9 ms of its 26.4 ms in this kernel, ~145 TFLOP/s against the card's ~790 (lab/notes/gpu_notes.md,
lead 2). For each case the K/V of every sequence sit in a paged pool (contiguous slots, the new
tokens' K/V already stored, as the model stores them before attending), and one CUDA graph calls
extend_attention once per layer copy (4 copies). Figures are the median time per call and the
causal attention's TFLOP/s (4 x head_dim flops per visible query-key pair and head). The
backend's launch (64 x 64 tiles, 4 warps, 3 pipeline stages) comes first, then a few packed-GQA
launches (a program per kv head over its q heads), then the grid of block_m, block_n, num_warps,
num_stages and packing until --budget-s; every variant is checked against the default's output.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for app

from app.kernels.triton_extend import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, extend_attention, extend_blocks  # noqa: E402
from bench_gemv import time_graph  # noqa: E402  (lab/tools/, this script's folder, is on sys.path)
from sweep_cli import case_deadlines, parse_sweep_args, require_cuda, sweep_variants  # noqa: E402

MODELS = {"1B": dict(heads=32, kv_heads=8, head_dim=64), "8B": dict(heads=32, kv_heads=8, head_dim=128)}
CASES = {  # (sequences, new tokens each, cached prefix each): the 256 benchmark's chunk, longer, on a prefix
    "1B": [(16, 512, 0), (4, 2048, 0), (1, 2048, 2048)],
    "8B": [(16, 512, 0)],
}
LAYER_COPIES = 4
DEFAULT = {"block_m": DEFAULT_BLOCK_M, "block_n": DEFAULT_BLOCK_N, "num_warps": 4, "num_stages": 3, "pack_gqa": False}
FOCUSED = [  # the q heads of a kv head in one program (K/V loaded once per group), tiles of 64-128 rows
    {"block_m": 16, "pack_gqa": True}, {"block_m": 32, "pack_gqa": True, "num_warps": 8},
    {"block_m": 16, "pack_gqa": True, "block_n": 128}, {"block_m": 128, "num_warps": 8},
]
SWEEP = [{"block_m": m, "block_n": n, "num_warps": w, "num_stages": s, "pack_gqa": g}  # packed or not alternate
         for n, w, m, s, g in itertools.product((64, 128, 32), (4, 8), (64, 32, 16, 128), (3, 2, 4), (False, True))]


def causal_flops(seqs: int, new: int, prefix: int, heads: int, head_dim: int) -> float:
    """4 x head_dim flops (q.k and p.v, multiply-adds) per visible (query, key) pair and head."""
    pairs = new * prefix + new * (new + 1) / 2
    return 4.0 * head_dim * heads * seqs * pairs


def run_case(model: str, seqs: int, new: int, prefix: int, repeats: int, deadline: float) -> dict:
    shape = MODELS[model]
    heads, kv_heads, head_dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    context = prefix + new
    slots = seqs * context + 1  # slot 0: the pool's dummy
    caches = [(torch.randn(slots, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16),
               torch.randn(slots, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYER_COPIES)]
    req_to_token = (1 + torch.arange(seqs * context, device="cuda", dtype=torch.int32)).view(seqs, context)
    req_pool_indices = torch.arange(seqs, device="cuda")
    prefix_lens = torch.full((seqs,), prefix, device="cuda", dtype=torch.int64)
    extend_lens = torch.full((seqs,), new, device="cuda", dtype=torch.int64)
    q = torch.randn(seqs * new, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    flops = causal_flops(seqs, new, prefix, heads, head_dim)

    def launch(knobs: dict) -> float:
        blocks = extend_blocks(extend_lens, [new] * seqs, knobs["block_m"])

        def calls() -> None:
            for k_cache, v_cache in caches:
                extend_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, blocks,
                                 out=out, block_n=knobs["block_n"], num_warps=knobs["num_warps"],
                                 num_stages=knobs["num_stages"], pack_gqa=knobs["pack_gqa"])

        return time_graph(calls, repeats) / LAYER_COPIES

    def figures(ms: float) -> dict:
        return {"us": round(ms * 1e3, 2), "tflops": round(flops / (ms * 1e-3) / 1e12, 1)}

    default = {**DEFAULT, **figures(launch(DEFAULT))}
    variants, best = sweep_variants(
        DEFAULT, FOCUSED + SWEEP, deadline, launch, out, describe=dict, figures=figures,
        skip=lambda knobs: knobs["pack_gqa"] and knobs["block_m"] * heads // kv_heads > 256,  # a packed tile past 256 rows spills
    )
    caches.clear()
    torch.cuda.empty_cache()
    return {"model": model, "seqs": seqs, "new": new, "prefix": prefix, "flops": flops, "default": default,
            "best": best, "variants": variants}


def label(entry: dict) -> str:
    packed = " gqa" if entry["pack_gqa"] else ""
    return f"m{entry['block_m']} n{entry['block_n']} w{entry['num_warps']} p{entry['num_stages']}{packed}"


def main() -> None:
    options, models = parse_sweep_args(__doc__.split("\n\n")[0], tuple(MODELS), ("sequences", "new", "prefix"))
    props = require_cuda("bench_extend_attention")
    started = time.perf_counter()
    cases = [(m, *case) for m in models for case in (options.cases or CASES[m])]
    results = []
    for (model, seqs, new, prefix), deadline in zip(cases, case_deadlines(len(cases), options.budget_s)):
        result = run_case(model, seqs, new, prefix, options.repeats, deadline)
        results.append(result)
        d, b = result["default"], result["best"]
        best = f"best {label(b)}: {b['us']:8.1f} us {b['tflops']:6.1f} TFLOP/s (x{d['us'] / b['us']:.2f})" if b else "no variant"
        print(f"{model} {seqs:>3} x {new:<5} on {prefix:<5} default {label(d)}: {d['us']:8.1f} us "
              f"{d['tflops']:6.1f} TFLOP/s | {best}", flush=True)
    if options.json:
        Path(options.json).write_text(json.dumps({"device": props.name, "elapsed_s": time.perf_counter() - started,
                                                  "cases": results}))


if __name__ == "__main__":
    main()
