"""The prefill MLP's gate_up projection with SiLU-and-mul in its epilogue against cuBLAS + our SiLU-and-mul (GPU).

    python tools/bench_gate_up_silu.py [--tokens 8192] [--shapes 1b,8b] [--repeats 20]

What a prefill step of 16 x 512 tokens runs for each layer's MLP input: torch's matmul of x
[M, K] by the fused gate_up weight [2I, K] (cuBLAS), then app/kernels/triton_activation.py's
SiLU-and-mul over the [M, 2I] result, against app/kernels/triton_gate_up_silu.py, which never
writes that intermediate, at each tiling of SWEEP (each first checked against the two kernels).
Each row times 4 layers' weights in one CUDA graph (tools/bench_gemv.time_graph) and prints ms a
layer, the matrix rate of the projection's 2 * M * 2I * K FLOP, and its ratio to the two
kernels' time (below 1: the fused kernel is faster). docs/gpu_notes.md, lead 2: it pays when
it costs less than the SiLU-and-mul it removes (~0.09 ms a layer at the 1B's shape).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.triton_activation import silu_and_mul  # noqa: E402
from app.kernels.triton_gate_up_silu import GateUpSiluConfig, gate_up_silu  # noqa: E402
from tools.bench_gemv import rel_err, time_graph  # noqa: E402

SHAPES = {"1b": (2048, 8192), "8b": (4096, 14336)}  # (hidden K, intermediate I)
LAYERS = 4
BASE = GateUpSiluConfig()  # 128 x 128 of each half, K steps of 64, 8 warps, 3 stages
# Tilings around the base (the two accumulators make a 128 x 128 block of each half as large as a
# 128 x 256 one of a plain matmul).
SWEEP = [BASE, BASE._replace(num_stages=4), BASE._replace(block_k=32, num_stages=5),
         BASE._replace(block_n=64, num_warps=4, num_stages=4), BASE._replace(block_m=64, num_warps=4, num_stages=4),
         BASE._replace(block_m=256, block_n=64), BASE._replace(group_m=16)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="rows of x (16 x 512 by default)")
    parser.add_argument("--shapes", default="1b,8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    dtype = torch.bfloat16
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        k, inter = SHAPES[shape]
        x = torch.randn(args.tokens, k, device="cuda", dtype=dtype)
        weights = [torch.randn(2 * inter, k, device="cuda", dtype=dtype) * k ** -0.5 for _ in range(LAYERS)]
        flop = 2 * args.tokens * 2 * inter * k
        two_kernels_ms = time_graph(lambda: [silu_and_mul(x @ w.T) for w in weights], args.repeats) / LAYERS
        print(f"{shape}: M {args.tokens}, K {k}, I {inter}; cuBLAS + silu_and_mul {two_kernels_ms:.3f} ms a layer "
              f"({flop / two_kernels_ms / 1e9:.0f} TFLOP/s)", flush=True)
        expected = silu_and_mul(x @ weights[0].T)
        for config in SWEEP:
            try:
                error = rel_err(gate_up_silu(x, weights[0], config=config), expected)
                ms = time_graph(lambda: [gate_up_silu(x, w, config=config) for w in weights], args.repeats) / LAYERS
            except Exception as exc:  # a tiling that does not build or fit is a row of the sweep
                print(f"  {config.label():28s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
                continue
            print(f"  {config.label():28s} {ms:.3f} ms  {flop / ms / 1e9:4.0f} TFLOP/s  x{ms / two_kernels_ms:.3f}  "
                  f"rel err {error:.1e}", flush=True)


if __name__ == "__main__":
    main()
