"""lab/tools/bench_read_rate.py's read kernels sum each element once: the 1-D kernel over strided or
chunked tiles (programs with unequal shares, some idle), with a cache modifier and an L2 policy;
the TMA kernel over 2-D boxes; and its check refuses a sum that missed a tile. Its fused-MLP
pattern reads every weight once, computes the MLP against float64 (one sum a program or atomics
into [K], columns in order or rotated), and its atomics split over rows add up to the whole."""

from __future__ import annotations

import pytest
import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from bench_read_rate import ROW, MlpPattern, Read, Tma, check_sums, mlp_pattern, tma_read, triton_read


def flat(elements: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(elements, generator=gen).to(torch.bfloat16).to(device)


@pytest.mark.parametrize("read", [Read(tile=1024), Read(tile=1024, chunked=True), Read(tile=2048, chunked=True),
                                  Read(tile=1024, cache=".cg", evict="evict_first")],
                         ids=["strided", "chunked", "chunked-idle", "cg-evict-first"])
@pytest.mark.parametrize("programs", [3, 8])
def test_read_kernel_sums_every_element(read: Read, programs: int, device: torch.device) -> None:
    buf = flat(1024 * 10, device)
    sums = torch.full((programs,), float("nan"), device=device)
    triton_read(read, buf, sums)
    assert torch.isfinite(sums).all()  # idle programs store a zero sum
    assert float(sums.double().sum()) == pytest.approx(float(buf.double().sum()), rel=1e-4, abs=1e-2)
    check_sums(buf, sums)


@pytest.mark.parametrize("tma", [Tma(box_r=4, box_c=256), Tma(box_r=8, box_c=512)], ids=["4x256", "8x512"])
def test_tma_kernel_sums_every_element(tma: Tma, device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("TMA needs compute capability 9.0")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    rows = 16
    buf = flat(rows * ROW, device, seed=1)
    sums = torch.full((5,), float("nan"), device=device)
    tma_read(tma, TensorDescriptor.from_tensor(buf.view(rows, ROW), [tma.box_r, tma.box_c]), rows, sums)
    assert float(sums.double().sum()) == pytest.approx(float(buf.double().sum()), rel=1e-4, abs=1e-2)


def test_check_refuses_a_missed_tile(device: torch.device) -> None:
    buf = flat(1024 * 4, device, seed=2) + 1.0  # a positive mean: a missing tile moves the sum
    sums = torch.zeros(2, device=device)
    triton_read(Read(tile=1024), buf[:1024 * 3], sums)
    with pytest.raises(RuntimeError, match="differs"):
        check_sums(buf, sums)


@pytest.mark.parametrize("rotate", [False, True], ids=["in-order", "rotated"])
@pytest.mark.parametrize("programs", [2, 3])
def test_mlp_pattern_reads_every_weight_and_computes_the_mlp(programs: int, rotate: bool,
                                                             device: torch.device) -> None:
    """Without its dot products the pattern kernel sums every weight once; with them (and its
    prologue) it computes down(silu(gate) * up) of rms_norm(x + residual) * norm_w (float32,
    unrounded): summed into one number a program, or added into [K] with atomics."""
    k, intermediate = 512, 8  # K: two 256-column rotations
    weights = flat(3 * intermediate * k, device, seed=3).view(3 * intermediate, k)
    w_gu, w_down_t = weights[:2 * intermediate], weights[2 * intermediate:]
    x, residual = flat(k, device, seed=4).float(), flat(k, device, seed=5)
    norm_w = flat(k, device, seed=6)
    sums = torch.full((programs,), float("nan"), device=device)
    out = torch.zeros(k, device=device)
    plain = MlpPattern(block_n=4, warps=4, rotate=rotate)
    mlp_pattern(plain, w_gu, w_down_t, x, residual, norm_w, sums, out)
    check_sums(weights.reshape(-1), sums)
    h = x.double() + residual.double()
    normed = h / torch.sqrt((h * h).mean() + 1e-5) * norm_w.double()
    y = w_gu.double() @ normed
    gate, up = y[:intermediate], y[intermediate:]
    expected = (gate * torch.sigmoid(gate) * up) @ w_down_t.double()
    mlp_pattern(plain._replace(reduce=True, prologue=True), w_gu, w_down_t, x, residual, norm_w, sums, out)
    assert float(sums.double().sum()) == pytest.approx(float(expected.sum()), rel=1e-3, abs=1e-2)
    mlp_pattern(plain._replace(reduce=True, prologue=True, atomic=True), w_gu, w_down_t, x, residual, norm_w,
                sums, out)
    assert torch.allclose(out.double().cpu(), expected.cpu(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("split", [2, 4])
def test_mlp_pattern_split_atomics_sum_to_the_whole(split: int, device: torch.device) -> None:
    """With its atomics split over rows (program p into row p % split) the rows sum to the
    unsplit result, and programs use every row."""
    k, intermediate = 256, 16
    weights = flat(3 * intermediate * k, device, seed=7).view(3 * intermediate, k)
    x, residual, norm_w = flat(k, device, seed=8).float(), flat(k, device, seed=9), flat(k, device, seed=10)
    sums = torch.zeros(4, device=device)
    whole = MlpPattern(reduce=True, prologue=True, atomic=True, block_n=4, warps=4)
    out = torch.zeros(k, device=device)
    mlp_pattern(whole, weights[:2 * intermediate], weights[2 * intermediate:], x, residual, norm_w, sums, out)
    rows = torch.zeros(split * k, device=device)
    mlp_pattern(whole._replace(split=split), weights[:2 * intermediate], weights[2 * intermediate:], x, residual,
                norm_w, sums, rows)
    parts = rows.view(split, k)
    assert bool((parts.abs().sum(dim=1) > 0).all())
    assert torch.allclose(parts.sum(dim=0).cpu(), out.cpu(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pairs", [1, 2], ids=["one-pair", "two-pairs"])
@pytest.mark.parametrize("programs", [2, 3])
def test_mlp_warp_rows_pattern_computes_the_mlp(pairs: int, programs: int, device: torch.device) -> None:
    """The warp-rows layout (a warp on each pair, the tile viewed chunk-major) computes the same
    MLP as the plain pattern: one sum a program, or added into [K] with atomics; it refuses a
    launch whose warps do not match its pairs."""
    k, intermediate = 512, 8
    weights = flat(3 * intermediate * k, device, seed=11).view(3 * intermediate, k)
    w_gu, w_down_t = weights[:2 * intermediate], weights[2 * intermediate:]
    x, residual, norm_w = flat(k, device, seed=12).float(), flat(k, device, seed=13), flat(k, device, seed=14)
    h = x.double() + residual.double()
    normed = h / torch.sqrt((h * h).mean() + 1e-5) * norm_w.double()
    y = w_gu.double() @ normed
    gate, up = y[:intermediate], y[intermediate:]
    expected = (gate * torch.sigmoid(gate) * up) @ w_down_t.double()
    rows = MlpPattern(reduce=True, warp_rows=True, prologue=True, block_n=2 * pairs, warps=pairs)
    sums = torch.full((programs,), float("nan"), device=device)
    out = torch.zeros(k, device=device)
    mlp_pattern(rows, w_gu, w_down_t, x, residual, norm_w, sums, out)
    assert float(sums.double().sum()) == pytest.approx(float(expected.sum()), rel=1e-3, abs=1e-2)
    mlp_pattern(rows._replace(atomic=True), w_gu, w_down_t, x, residual, norm_w, sums, out)
    assert torch.allclose(out.double().cpu(), expected.cpu(), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="a warp a pair"):
        mlp_pattern(rows._replace(warps=2 * pairs), w_gu, w_down_t, x, residual, norm_w, sums, out)
