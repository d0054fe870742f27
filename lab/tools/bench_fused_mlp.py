"""The batch-1 MLP in one kernel (fused-mlp) against gate_up + down as the model runs them (GPU).

    python lab/tools/bench_fused_mlp.py [--hidden 2048] [--intermediate 8192] [--repeats 15]
                                        [--configs "block_n=8,num_warps=8;num_stages=4"]

The 1B's MLP of one token, 16 layers' weights (past the L2) in one CUDA graph of back-to-back
calls, as lab/tools/bench_gemv.py times: the persistent gate_up gemv with the norm prologue and the
SiLU epilogue, then down's row-block gemv (the defaults of fused-decode), against
app/kernels/triton_fused_mlp.py at each tiling of the sweep (rows a tile, warps, stages,
programs an SM, its first tile early; or ``--configs``: ``fused-mlp-config`` kernel-option specs separated
by ";", each changing the tuned config, as the engine's flag would), each first checked against
the pair's output. Prints µs a layer and the bandwidth of the bytes read (gate_up's and down's
weights).

``--before-qkv``: each layer the MLP kernel (letting the next kernel in after its tile loop, as
the engine launches it by default, or at its programs' start) and then the next layer's qkv
projection as the engine runs it (the norm prologue over the kernel's float32 sum, the rotary
and K/V-store epilogue: 3072 x 2048 at the 1B), launched as the MLP kernel's programmatic
dependent that waits (``qkv=wait``, the default) or preloads its first tile, or plainly. With
``--probe`` each row also prints where and when both kernels' programs ran, and the handover:
from the MLP kernel's last program's end, qkv's first start, first wait end and last end (qkv
costs ~3 us a layer over its bytes; lab/notes/gpu_notes.md, "The next calls").
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for app

from app.engine.kernel_specs import FusedMlpKnobs  # noqa: E402
from app.kernels.triton_fused_mlp import FusedMlpConfig, down_transposed, fused_mlp  # noqa: E402
from app.kernels.triton_gemv import (  # noqa: E402
    RotaryStore,
    default_config,
    device_sms,
    gemv,
    gemv_add_rms_norm,
    rows_config,
)
from app.kernels.triton_probe import PROBE_FIELDS  # noqa: E402
from app.kernels.triton_rotary import cos_sin_tables  # noqa: E402
from bench_gemv import rel_err, time_graph  # noqa: E402  (lab/tools/, this script's folder, is on sys.path)

LAYERS = 16
BEST = FusedMlpConfig()  # 4 rows, 8 warps, 4 stages, at most 1 an SM, as many tiles each (even_programs)
# The tuned config, its first tile early, and the neighbours of its tiling (11-30, twelfth session:
# none faster than the tuned one, lab/notes/benchmarks.md "Slots recorded a step and the fused MLP at
# one program an SM"; the ninth session's tuning, 2 an SM at 3 stages, is among them; earlier,
# 2 rows at 4 stages 26.9-27.2 against 26.8 and 16 warps 59-98).
SWEEP = [BEST, BEST._replace(early_tile=True), BEST._replace(num_stages=3), BEST._replace(num_stages=5),
         BEST._replace(programs_per_sm=2, num_stages=3), BEST._replace(programs_per_sm=2), BEST._replace(block_n=8),
         BEST._replace(num_warps=4), BEST._replace(block_n=2, programs_per_sm=2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--configs", default=None,
                        help='fused-mlp-config kernel-option specs (name=value+...) separated by ";" (default: the built-in sweep)')
    parser.add_argument("--before-qkv", action="store_true",
                        help="the MLP kernel then the next qkv gemv a layer, qkv a dependent or launched plainly")
    parser.add_argument("--probe", action="store_true",
                        help="with --before-qkv: where and when each program of both kernels ran "
                             "(app/kernels/triton_probe.py)")
    args = parser.parse_args()
    if args.before_qkv:
        before_qkv(args.hidden, args.intermediate, args.repeats, args.probe)
        return
    sweep = SWEEP if args.configs is None else [
        BEST._replace(**FusedMlpKnobs.parse(spec).changes()) for spec in args.configs.split(";")]
    k, inter, dtype = args.hidden, args.intermediate, torch.bfloat16
    torch.manual_seed(0)
    gate_ups = [torch.randn(2 * inter, k, device="cuda", dtype=dtype) * k ** -0.5 for _ in range(LAYERS)]
    downs = [torch.randn(k, inter, device="cuda", dtype=dtype) * inter ** -0.5 for _ in range(LAYERS)]
    downs_t = [down_transposed(d) for d in downs]
    x, residual = (torch.randn(1, k, device="cuda", dtype=dtype) for _ in range(2))
    norm_w = torch.ones(k, device="cuda", dtype=dtype)
    bytes_a_layer = (3 * inter * k) * 2
    gate_up_config = rows_config(2 * inter, k, even=True)

    def pair() -> torch.Tensor:
        out = None
        for gu, d in zip(gate_ups, downs):
            act, _ = gemv_add_rms_norm(x, residual, norm_w, 1e-5, gu, silu_mul=True, config=gate_up_config)
            out = gemv(act, d)
        return out

    want = pair().float()
    ms = time_graph(pair, args.repeats)
    print(f"{'gate_up (persistent) + down':<34} {ms * 1e3 / LAYERS:7.2f} us a layer  "
          f"{bytes_a_layer * LAYERS / ms / 1e9:5.2f} TB/s", flush=True)
    sums = torch.zeros(LAYERS, 1, k, device="cuda", dtype=torch.float32)
    for config in sweep:
        def fused(config: FusedMlpConfig = config) -> None:
            sums.zero_()
            for gu, d_t, layer_sum in zip(gate_ups, downs_t, sums):
                fused_mlp(x, residual, norm_w, 1e-5, gu, d_t, layer_sum, config=config)
        try:
            fused()
            err = rel_err(sums[-1], want)
            ms = time_graph(fused, args.repeats)
        except Exception as exc:  # a tiling that does not build or fit: reported, the sweep goes on
            print(f"{str(config):<34} failed: {str(exc)[:200]}", flush=True)
            continue
        print(f"{str(config):<34} {ms * 1e3 / LAYERS:7.2f} us a layer  "
              f"{bytes_a_layer * LAYERS / ms / 1e9:5.2f} TB/s  rel err {err:.2e}", flush=True)


# A row: the qkv gemv's PDL mode ("" a plain launch) and whether the MLP kernel lets it launch at its
# programs' start (else after their tile loop, the engine's default).
BEFORE_QKV = [("wait", False), ("wait", True), ("preload", True), ("", False)]
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64  # the 1B's attention


def before_qkv(k: int, inter: int, repeats: int, probe: bool = False) -> None:
    """The ``--before-qkv`` rows (see the module docstring), each row's q checked against the first's."""
    dtype = torch.bfloat16
    torch.manual_seed(0)
    gate_ups = [torch.randn(2 * inter, k, device="cuda", dtype=dtype) * k ** -0.5 for _ in range(LAYERS)]
    downs_t = [down_transposed(torch.randn(k, inter, device="cuda", dtype=dtype) * inter ** -0.5)
               for _ in range(LAYERS)]
    n_qkv = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    w_qkvs = [torch.randn(n_qkv, k, device="cuda", dtype=dtype) * k ** -0.5 for _ in range(LAYERS)]
    x, residual = (torch.randn(1, k, device="cuda", dtype=dtype) for _ in range(2))
    norm_w = torch.ones(k, device="cuda", dtype=dtype)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda", dtype=torch.float32) / HEAD_DIM))
    cos, sin = cos_sin_tables(inv_freq, 2048)
    caches = [torch.zeros((64, KV_HEADS, HEAD_DIM), device="cuda", dtype=dtype) for _ in range(2)]
    rot = RotaryStore(cos, sin, torch.tensor([700], device="cuda"), torch.tensor([9], device="cuda"), *caches, Q_HEADS)
    sums = torch.zeros(LAYERS, 1, k, device="cuda", dtype=torch.float32)
    qs = torch.empty(LAYERS, 1, n_qkv, device="cuda", dtype=dtype)
    programs = n_qkv // default_config(1, n_qkv, k, device_sms(torch.device("cuda"))).block_n  # its row blocks
    probes = torch.zeros(LAYERS, PROBE_FIELDS * programs, device="cuda", dtype=torch.int64)
    mlp_probes = torch.zeros(LAYERS, PROBE_FIELDS * device_sms(torch.device("cuda")) * BEST.programs_per_sm,
                             device="cuda", dtype=torch.int64)
    bytes_a_layer = (3 * inter * k + n_qkv * k) * 2
    first = None
    for qkv_mode, at_start in BEFORE_QKV:
        def layers(qkv_mode: str = qkv_mode, at_start: bool = at_start, probed: bool = False) -> None:
            sums.zero_()
            for gu, d_t, layer_sum, w_qkv, q, layer_probe, mlp_probe in zip(gate_ups, downs_t, sums, w_qkvs, qs,
                                                                             probes, mlp_probes):
                _, h = fused_mlp(x, residual, norm_w, 1e-5, gu, d_t, layer_sum, trigger=True,
                                 trigger_at_start=at_start, probe=mlp_probe if probed else None)
                gemv_add_rms_norm(layer_sum, h, norm_w, 1e-5, w_qkv, out=q, pdl=qkv_mode, rotary=rot,
                                  probe=layer_probe if probed else None)
        layers()
        torch.cuda.synchronize()
        got = qs[-1, :, :Q_HEADS * HEAD_DIM].clone()
        first = got if first is None else first
        ms = time_graph(layers, repeats)
        label = (f"MLP{' (trigger at start)' if at_start else ''}, qkv "
                 f"{'a dependent (' + qkv_mode + ')' if qkv_mode else 'plain'}")
        print(f"{label:<40} {ms * 1e3 / LAYERS:7.2f} us a layer  {bytes_a_layer * LAYERS / ms / 1e9:5.2f} TB/s  "
              f"rel err {rel_err(got, first.double()):.1e}", flush=True)
        if probe:
            time_graph(functools.partial(layers, probed=True), 3)  # the last replay's records stay in probes
            print(f"{'':<40} MLP: {placement(mlp_probes)}", flush=True)
            print(f"{'':<40} qkv: {placement(probes)}", flush=True)
            print(f"{'':<40} {handover(mlp_probes, probes)}", flush=True)


def handover(before: torch.Tensor, after: torch.Tensor) -> str:
    """Medians over layers 1-15 of two probed kernels in a row (records as :func:`placement`
    reads them), in µs from the first kernel's last program's end: when the second's first
    program started (negative: launched early, a programmatic dependent) and its first wait
    ended, and its last program's end (the second kernel's share of the critical path)."""
    rows = []
    for first, second in zip(before[1:].view(before.shape[0] - 1, -1, PROBE_FIELDS).cpu(),
                             after[1:].view(after.shape[0] - 1, -1, PROBE_FIELDS).cpu()):
        first, second = first[first[:, 1] > 0], second[second[:, 1] > 0]
        done = first[:, 3].max()
        rows.append(((second[:, 1].min() - done) / 1e3, (second[:, 2].min() - done) / 1e3,
                     (second[:, 3].max() - done) / 1e3))
    med = [statistics.median(column) for column in zip(*rows)]
    return (f"after the first kernel's end: the second's first start {med[0]:+.2f} us, first wait end "
            f"{med[1]:+.2f}, last end {med[2]:+.2f}")


def placement(probes: torch.Tensor) -> str:
    """Medians over layers 1-15 (layer 0 follows the graph's start) of a probed kernel's records
    ([layers, programs * 4]: SM, start, end of the wait, end; programs that never ran are zero):
    the SMs its programs ran on and the most on one, the spread of their starts, how long after
    the first start the first wait ended, the spread of the wait's ends, the first wait's end to
    the last program's end (the kernel's run) and the spread of the programs' ends (its tail), in µs."""
    rows = []
    for layer in probes[1:].view(probes.shape[0] - 1, -1, PROBE_FIELDS).cpu():
        layer = layer[layer[:, 1] > 0]
        sms, counts = layer[:, 0].unique(return_counts=True)
        start, waited, end = layer[:, 1], layer[:, 2], layer[:, 3]
        rows.append((len(sms), int(counts.max()), (start.max() - start.min()) / 1e3, (waited.min() - start.min()) / 1e3,
                     (waited.max() - waited.min()) / 1e3, (end.max() - waited.min()) / 1e3,
                     (end.max() - end.min()) / 1e3))
    med = [statistics.median(column) for column in zip(*rows)]
    return (f"{len(layer)} programs on {med[0]:.0f} SMs (at most {med[1]:.0f} on one); starts spread {med[2]:.2f} us, "
            f"first wait ends {med[3]:.2f} us after the first start, waits' ends spread {med[4]:.2f}, run {med[5]:.2f}, "
            f"ends spread {med[6]:.2f}")


if __name__ == "__main__":
    main()
