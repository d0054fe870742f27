"""Can a batch-1 context's K/V stay in the L2 between decode steps, and what would its attention gain?

    python tools/bench_kv_l2.py [--contexts 640,1152] [--layers 16] [--repeats 20]

Why: at batch 1 the decode attention's two kernels take ~6 µs a layer of the 1B's ~42 while HBM
idles (docs/gpu_notes.md, lead 1 (a)); stage 1 waits on its K and then its V from HBM, because
the ~2.5 GB of weights a step streams through the 50 MB L2 between two reads of a layer's K/V.
That context's K/V is small (2 KB a token a layer: 1,152 tokens x 16 layers is 38 MB), so an L2
that kept it would serve stage 1's loads at L2 latency.

One CUDA graph plays a step's shape: per layer, a weight stream of the 1B layer's bytes (a
matrix-vector product over its own 121.6 MB matrix, so nothing of it is in the L2 next time),
then our decode attention over that layer's K/V. Timed per layer (median of the replays):
- weights only, and weights + attention (the attention's cost on the critical path is the difference);
- weights + attention with stage 1's K/V loads ``evict_last`` (``decode_attention(kv_eviction=)``);
- both again with part of the L2 set aside for persisting lines (``cudaLimitPersistingL2CacheSize``:
  the programming guide's persisting accesses; whether ``evict_last`` lines use it is the question);
- attention only (16 layers' K/V back to back, at most 38 MB: mostly L2 hits), the floor.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.triton_decode import decode_attention  # noqa: E402
from bench_gemv import time_graph  # noqa: E402  (tools/, this script's folder, is on sys.path)
from sweep_cli import require_cuda  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 32, 8, 64, 2048  # llama-3.2-1b
LAYER_WEIGHT_BYTES = (3072 + 2048 + 2 * 8192 + 8192) * HIDDEN * 2  # qkv, o, gate_up, down (bf16)
CUDA_LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize
CUDA_ATTR_MAX_PERSISTING_L2 = 108  # cudaDevAttrMaxPersistingL2CacheSize


def load_cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (its path read from this process's mappings, so the same copy)."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    for path in sorted(paths) + ["libcudart.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError("bench_kv_l2: no libcudart found to set the L2's persisting set-aside")


def set_persisting_l2(cudart: ctypes.CDLL, size: int) -> int:
    """Set aside ``size`` bytes of L2 for persisting accesses (capped at the device's maximum); the size set."""
    limit = ctypes.c_size_t(0)
    status = cudart.cudaDeviceSetLimit(CUDA_LIMIT_PERSISTING_L2, ctypes.c_size_t(size))
    if status != 0:
        raise RuntimeError(f"bench_kv_l2: cudaDeviceSetLimit(persisting L2, {size}) returned {status}")
    cudart.cudaDeviceGetLimit(ctypes.byref(limit), CUDA_LIMIT_PERSISTING_L2)
    return limit.value


def max_persisting_l2(cudart: ctypes.CDLL) -> int:
    value = ctypes.c_int(0)
    cudart.cudaDeviceGetAttribute(ctypes.byref(value), CUDA_ATTR_MAX_PERSISTING_L2, torch.cuda.current_device())
    return value.value


class Step:
    """``layers`` layers' weights and one sequence's K/V at ``context`` tokens (contiguous slots)."""

    def __init__(self, context: int, layers: int) -> None:
        rows = LAYER_WEIGHT_BYTES // (HIDDEN * 2)
        self.weights = [torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        self.x = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.y = torch.empty(rows, device="cuda", dtype=torch.bfloat16)
        slots = context + 1  # slot 0: the pool's dummy
        self.kv = [(torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                    torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]
        self.table = torch.arange(1, slots, device="cuda", dtype=torch.int32)[None, :].contiguous()
        self.req = torch.zeros(1, device="cuda", dtype=torch.int64)
        self.lens = torch.full((1,), context, device="cuda", dtype=torch.int64)
        self.q = torch.randn(1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)

    def attend(self, layer: int, eviction: str) -> None:
        k, v = self.kv[layer]
        decode_attention(self.q, k, v, self.table, self.req, self.lens, None, out=self.out, block_n=64,
                         num_warps=4, prefetch_slots=True, kv_eviction=eviction)

    def calls(self, weights: bool, attention: bool, eviction: str = ""):
        def run() -> None:
            for layer in range(len(self.weights)):
                if weights:
                    torch.mv(self.weights[layer], self.x, out=self.y)
                if attention:
                    self.attend(layer, eviction)
        return run


def run_context(step: Step, context: int, layers: int, repeats: int, cudart: ctypes.CDLL, most: int) -> None:
    """Every row of one context, with no set-aside and then the most the device allows."""
    kv_mb = 2 * layers * context * KV_HEADS * HEAD_DIM * 2 / 1e6
    per_layer = 1000.0 / layers  # ms a graph -> us a layer

    def timed(label: str, *how) -> float:
        us = time_graph(step.calls(*how), repeats) * per_layer
        print(f"  {label:<44} {us:8.2f} us a layer", flush=True)
        return us

    print(f"context {context}: K/V {kv_mb:.1f} MB over {layers} layers, weights {LAYER_WEIGHT_BYTES / 1e6:.1f} MB a layer")
    for set_aside in (0, most):
        got = set_persisting_l2(cudart, set_aside)
        print(f" set-aside {got / 2**20:.1f} MiB")
        alone = timed("weights only", True, False)
        plain = timed("weights + attention", True, True)
        kept = timed("weights + attention, K/V evict_last", True, True, "evict_last")
        plain2 = timed("weights + attention (again)", True, True)
        print(f"  attention on the critical path: {plain - alone:.2f} / {plain2 - alone:.2f} plain, "
              f"{kept - alone:.2f} evict_last ({(plain + plain2) / 2 - kept:+.2f} us a layer saved)")
    set_persisting_l2(cudart, 0)
    timed("attention only (L2-hot K/V)", False, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="640,1152")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    require_cuda("bench_kv_l2")
    cudart = load_cudart()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    most = max_persisting_l2(cudart)
    print(f"L2 {l2 / 2**20:.0f} MiB, persisting set-aside at most {most / 2**20:.1f} MiB")
    for context in (int(c) for c in args.contexts.split(",")):
        run_context(Step(context, args.layers), context, args.layers, args.repeats, cudart, most)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
