"""Our triton decode attention on the GPU: its launch knobs swept at the decode shapes that matter.

    python lab/tools/bench_decode_attention.py [--models 1B,8B] [--repeats 10] [--budget-s 90] [--json PATH]

For each (model, batch, context) case the K/V of every sequence sit in a paged pool (contiguous
slots, as after a prefill), and one CUDA graph calls decode_attention once per layer copy, over
enough copies (>= 512 MB of K/V in all) that no layer's K/V is still in the 50 MB L2 when it is
read again, as in a model whose weights stream through L2 between two attention calls. Figures
are the median time per call; GB/s is the K/V bytes read per call over it (the kernel's floor),
% of the H200's measured copy bandwidth (4.23 TB/s). The backend's launch (its split cap, key
block and warps for the batch, V loaded after the softmax, each block loading the next block's
slots, triton's default pipelining, stage 2 merging the splits) comes first, then a few single
changes to it (pipelining depth, the splits merged in stage 1 as ``fused-split-reduce`` does,
a fixed split cap down to one split: one kernel, or splits of more tokens), then the sweep of
block_n, num_warps, early_v and the split cap, until --budget-s. Every variant is checked
against the default's output.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for app

from app.engine.attention.triton_backend import TritonAttentionBackend, decode_block_n_for, split_cap_for  # noqa: E402
from app.kernels.triton_decode import DEFAULT_MIN_SPLIT_LEN, decode_attention, num_kv_splits_for  # noqa: E402
from bench_gemv import time_graph  # noqa: E402  (lab/tools/, this script's folder, is on sys.path)
from sweep_cli import case_deadlines, parse_sweep_args, require_cuda, sweep_variants  # noqa: E402

COPY_BW_TBS = 4.23
MODELS = {"1B": dict(heads=32, kv_heads=8, head_dim=64), "8B": dict(heads=32, kv_heads=8, head_dim=128)}
CASES = {  # (batch, context): batch 1 short and long, serving sizes, the 256-request benchmark
    "1B": [(1, 640), (1, 4096), (4, 1024), (16, 1024), (32, 1024), (64, 576), (256, 576), (256, 2048)],
    "8B": [(1, 640), (256, 576)],
}
# The backend's launch: block_n None and num_warps None follow its rules for the batch
# (TritonAttentionBackend.decode_launch: 64 keys, or 128 at mid batches; warps by the split cap).
# Each block loads the next block's slots, as the backend does on CUDA (variant 63).
DEFAULT = {"block_n": None, "num_warps": None, "early_v": False, "prefetch_slots": True, "cap_factor": 1,
           "num_stages": None, "reduce_in_stage1": False, "old_rule": False, "cap": None,
           "min_split_len": DEFAULT_MIN_SPLIT_LEN}
FOCUSED = [  # single changes to the default, timed first
    {"old_rule": True},  # the split cap before 11-30: two programs an SM at every batch size
    {"block_n": 64},  # 64 keys a step at every batch (the rule before 11-30's 128 at mid batches, variant 61)
    {"num_stages": 1}, {"num_stages": 2}, {"num_stages": 4}, {"reduce_in_stage1": True},
    {"early_v": True, "num_stages": 2}, {"reduce_in_stage1": True, "cap_factor": 2},
    {"cap_factor": 2}, {"cap_factor": 4},  # the split cap at mid batches (lab/notes/gpu_notes.md, lead 4)
    # Fewer, longer splits at small batches (lab/notes/gpu_notes.md, lead 1 (f)): a cap of 1 is one
    # kernel (stage 1 writes the output), with the K loop pipelined deeper; or splits of more tokens.
    {"cap": 1}, {"cap": 1, "num_stages": 3}, {"cap": 1, "num_warps": 4}, {"cap": 1, "num_warps": 4, "num_stages": 3},
    {"cap": 1, "block_n": 128, "num_warps": 4}, {"cap": 1, "block_n": 256, "num_warps": 8},
    {"cap": 2}, {"cap": 4}, {"cap": 8}, {"cap": 2, "reduce_in_stage1": True}, {"cap": 4, "reduce_in_stage1": True},
    {"cap": 2, "block_n": 128}, {"min_split_len": 128}, {"min_split_len": 256},
    # Each block loading its own slots (before variant 63): alone, and where programs walk many blocks.
    {"prefetch_slots": False}, {"prefetch_slots": False, "cap": 1, "block_n": 128, "num_warps": 4},
]
SWEEP = [  # then the grid: block_n, warps, early_v, cap factor
    {"block_n": n, "num_warps": w, "early_v": e, "cap_factor": c}
    for n, w, e, c in itertools.product((32, 64, 128), (2, 4, 8), (False, True), (1, 2))
]


def split_cap(batch: int, kv_heads: int, num_sms: int, max_splits: int = 16, old_rule: bool = False) -> int:
    """The backend's split cap at its default target (two programs an SM); ``old_rule``: the rule
    before 11-30, two programs an SM at every batch size."""
    if old_rule:
        return max(1, min(max_splits, math.ceil(2 * num_sms / (batch * kv_heads))))
    return split_cap_for(batch, kv_heads, 2 * num_sms, max_splits)


def run_case(model: str, batch: int, context: int, num_sms: int, repeats: int, deadline: float) -> dict:
    shape = MODELS[model]
    heads, kv_heads, head_dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    tokens = batch * context
    kv_bytes = 2 * tokens * kv_heads * head_dim * 2  # K and V, bf16
    copies = max(1, min(256, math.ceil(512 * 2**20 / kv_bytes)))
    slots = tokens + 1  # slot 0: the pool's dummy
    caches = [(torch.randn(slots, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16),
               torch.randn(slots, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    req_to_token = (1 + torch.arange(tokens, device="cuda", dtype=torch.int32)).view(batch, context)
    req_pool_indices = torch.arange(batch, device="cuda")
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int64)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    base_cap = split_cap(batch, kv_heads, num_sms)

    counters = torch.zeros((batch, kv_heads), dtype=torch.int32, device="cuda")

    def launch_of(knobs: dict) -> tuple[int, int, int]:
        """The split cap, keys a step and warps of ``knobs`` (block_n and num_warps None: the
        backend's rules for that batch and cap)."""
        base = split_cap(batch, kv_heads, num_sms, old_rule=True) if knobs["old_rule"] else base_cap
        cap = knobs["cap"] or min(16, base * knobs["cap_factor"])
        block_n = knobs["block_n"] or decode_block_n_for(batch, kv_heads, head_dim, cap, 2 * num_sms, 64)
        return cap, block_n, knobs["num_warps"] or TritonAttentionBackend.decode_num_warps(cap, block_n)

    def launch(knobs: dict) -> float:
        cap, block_n, warps = launch_of(knobs)
        splits = num_kv_splits_for(seq_lens, cap, knobs["min_split_len"])

        def calls() -> None:
            for k_cache, v_cache in caches:
                decode_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, splits,
                                 max_kv_splits=cap, out=out, block_n=block_n, num_warps=warps,
                                 early_v=knobs["early_v"], num_stages=knobs["num_stages"],
                                 prefetch_slots=knobs["prefetch_slots"],
                                 reduce_in_stage1=knobs["reduce_in_stage1"], split_counters=counters)

        return time_graph(calls, repeats) / copies

    def entry(knobs: dict) -> dict:
        described = {k: v for k, v in knobs.items() if k not in ("cap_factor", "cap")}
        cap, block_n, warps = launch_of(knobs)
        return {**described, "block_n": block_n, "num_warps": warps, "split_cap": cap}

    def figures(ms: float) -> dict:
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        return {"us": round(ms * 1e3, 2), "gbps": round(gbps), "pct": round(100 * gbps / (COPY_BW_TBS * 1e3), 1)}

    default = {**entry(DEFAULT), **figures(launch(DEFAULT))}
    # a [128, 128] K and V tile on 64 threads spills: not worth timing
    spills = lambda knobs: launch_of(knobs)[1] * head_dim > 128 * 64 and launch_of(knobs)[2] == 2  # noqa: E731
    focused, _ = sweep_variants(DEFAULT, FOCUSED, deadline, launch, out, describe=entry, figures=figures, skip=spills)
    launch(DEFAULT)  # the sweep compares against the default's output, in `out`
    swept, _ = sweep_variants(DEFAULT, SWEEP, deadline, launch, out, describe=entry, figures=figures, skip=spills)
    variants = focused + swept
    timed = [v for v in variants if "us" in v and v["rel_err"] < 2e-2]
    best = min(timed, key=lambda v: v["us"]) if timed else None
    caches.clear()  # the K/V copies go before the next case allocates its own
    torch.cuda.empty_cache()
    return {"model": model, "batch": batch, "context": context, "kv_bytes": kv_bytes, "copies": copies,
            "default": default, "best": best, "focused": focused, "variants": variants}


def label(entry: dict) -> str:
    stages = "" if entry.get("num_stages") is None else f" p{entry['num_stages']}"
    merge = " merge1" if entry.get("reduce_in_stage1") else ""
    rule = " old-rule" if entry.get("old_rule") else ""
    rule += "" if entry.get("prefetch_slots", True) else " no-pf"
    split_len = entry.get("min_split_len", DEFAULT_MIN_SPLIT_LEN)
    split = f" len{split_len}" if split_len != DEFAULT_MIN_SPLIT_LEN else ""
    return (f"n{entry['block_n']} w{entry['num_warps']} {'earlyV' if entry['early_v'] else 'lateV'} "
            f"cap{entry['split_cap']}{split}{stages}{merge}{rule}")


def main() -> None:
    options, models = parse_sweep_args(__doc__.split("\n\n")[0], tuple(MODELS), ("batch", "context"))
    props = require_cuda("bench_decode_attention")
    print(f"% of {COPY_BW_TBS} TB/s", flush=True)
    started = time.perf_counter()
    cases = [(m, b, c) for m in models for b, c in (options.cases or CASES[m])]
    results = []
    for (model, batch, context), deadline in zip(cases, case_deadlines(len(cases), options.budget_s)):
        result = run_case(model, batch, context, props.multi_processor_count, options.repeats, deadline)
        results.append(result)
        d, b = result["default"], result["best"]
        best = f"best {label(b)}: {b['us']:8.2f} us {b['pct']:5.1f}% (x{d['us'] / b['us']:.2f})" if b else "no variant"
        print(f"{model} bs{batch:<4} ctx{context:<5} default {label(d)}: {d['us']:8.2f} us {d['pct']:5.1f}% | {best}",
              flush=True)
        for variant in result["focused"]:  # the single changes, each against the default
            timing = f"{variant['us']:8.2f} us (x{d['us'] / variant['us']:.2f})" if "us" in variant else variant["error"]
            print(f"    {label(variant):<36} {timing}", flush=True)
    if options.json:
        Path(options.json).write_text(json.dumps({"device": props.name, "copy_bw_tbs": COPY_BW_TBS,
                                                  "elapsed_s": time.perf_counter() - started, "cases": results}))


if __name__ == "__main__":
    main()
