"""The batch-1 attention's split merge inside the o projection (--merge-o) against stage 2 + o's gemv (GPU).

    python tools/bench_merge_o.py [--seq-len 640] [--repeats 15]

The 1B's attention of one token after its qkv projection, 16 layers (each its own KV cache and
o weight, past the L2) in one CUDA graph of back-to-back calls, as tools/bench_gemv.py times:
stage 1, stage 2 (triggering at its start) and o's gemv launched as a preloading programmatic
dependent (the defaults of --fused-decode), against stage 1 alone then
app/kernels/triton_merge_o.py for each launch in the sweep (warps and rows a program, stage 1
triggering at its start or after its key loop, or a plain launch), each first checked against
the defaults' output. Prints µs a layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.triton_decode import DecodePartials, decode_attention  # noqa: E402
from app.kernels.triton_gemv import gemv  # noqa: E402
from app.kernels.triton_merge_o import MergeOConfig, merge_o_proj  # noqa: E402
from tools.bench_gemv import rel_err, time_graph  # noqa: E402

LAYERS = 16
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 32, 8, 64, 2048
# (config, how stage 1 lets the merge in: "start", "late" or "" for a plain launch)
SWEEP = [(MergeOConfig(64, 4), "start"), (MergeOConfig(64, 4), "late"), (MergeOConfig(64, 4), ""),
         (MergeOConfig(64, 1), "start"), (MergeOConfig(64, 1), "late"), (MergeOConfig(128, 4), "late"),
         (MergeOConfig(32, 1), "late")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=640)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    dtype, n = torch.bfloat16, args.seq_len
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    caches = [(torch.randn(n + 1, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype),
               torch.randn(n + 1, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)) for _ in range(LAYERS)]
    weights = [torch.randn(HIDDEN, HEADS * HEAD_DIM, device="cuda", dtype=dtype) * HIDDEN ** -0.5
               for _ in range(LAYERS)]
    table = torch.arange(1, n + 1, device="cuda", dtype=torch.int32)[None, :]
    rows = torch.zeros(1, device="cuda", dtype=torch.int64)
    seq_lens = torch.full((1,), n, device="cuda", dtype=torch.int64)
    attn_out = torch.empty(1, HEADS, HEAD_DIM, device="cuda", dtype=dtype)

    def defaults() -> torch.Tensor:
        out = None
        for (k_cache, v_cache), w in zip(caches, weights):
            decode_attention(q, k_cache, v_cache, table, rows, seq_lens, None, out=attn_out, trigger_dependents=True)
            out = gemv(attn_out.view(1, -1), w, pdl="preload")
        return out

    want = defaults().float()
    ms = time_graph(defaults, args.repeats)
    print(f"{'stage 1 + stage 2 + o (preload)':<40} {ms * 1e3 / LAYERS:7.2f} us a layer", flush=True)
    sums = torch.zeros(LAYERS, 1, HIDDEN, device="cuda", dtype=torch.float32)
    for config, trigger in SWEEP:
        def merged(config: MergeOConfig = config, trigger: str = trigger) -> None:
            sums.zero_()
            for (k_cache, v_cache), w, layer_sum in zip(caches, weights, sums):
                partials = decode_attention(q, k_cache, v_cache, table, rows, seq_lens, None, partials=True,
                                            trigger_dependents=bool(trigger), trigger_late=trigger == "late")
                assert isinstance(partials, DecodePartials)
                merge_o_proj(partials, w, layer_sum, pdl=bool(trigger), config=config)
        name = f"merge in o, {config.block_n} rows, {config.num_warps} warps, {trigger or 'plain'}"
        try:
            merged()
            err = rel_err(sums[-1], want)
            ms = time_graph(merged, args.repeats)
        except Exception as exc:  # a launch that does not build: reported, the sweep goes on
            print(f"{name:<40} failed: {str(exc)[:200]}", flush=True)
            continue
        print(f"{name:<40} {ms * 1e3 / LAYERS:7.2f} us a layer  rel err {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
