"""The decode-shaped linear kernel against float64 references: default and explicit configs, every
tiling family the heuristic returns, split-K, bias, strided x, poisoned outputs and bad inputs.

Shapes are small (triton's interpreter runs each program in Python); N and K are mostly not
multiples of the block sizes, so the masked tails are exercised along with full tiles.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DTYPES, REL_TOL, assert_close, poisoned, rel_err, rounded

from app.engine.models.layers import Linear
from app.kernels.triton_gemv import (
    FMA_MAX_M,
    H200_SMS,
    MAX_M,
    GemvConfig,
    default_config,
    effective_split,
    gemv,
    split_for,
)

LLAMA_SHAPES = [  # (N, K) of the Llama-3.2-1B and Llama-3.1-8B linears, lm_head included
    (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048),
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
]


def inputs(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *, bias: bool,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed * 7919 + m * 131 + n * 17 + k)
    x = torch.randn((m, k), generator=gen).to(dtype).to(device)
    weight = (torch.randn((n, k), generator=gen) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    return x, weight, b


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


def check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig | None) -> torch.Tensor:
    """Run into a NaN-poisoned output and compare: every element written, error within the dtype's
    tolerance and, sharper, hardly above the error of storing the exact result in that dtype
    (float32 accumulation adds ~1e-7; a missed K block or row would add far more)."""
    out = poisoned((x.shape[0], weight.shape[0]), x.dtype, x.device)
    result = gemv(x, weight, bias, config=config, out=out)
    assert result is out
    ref = reference(x, weight, bias)
    assert_close(out, ref, x.dtype)
    rounding = rel_err(rounded(ref, x.dtype), ref)
    assert rel_err(out, ref) <= 1.5 * rounding + 1e-5, (rel_err(out, ref), rounding, config)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize(("n", "k", "bias"), [(21, 100, True), (32, 256, False), (13, 300, False)])
def test_default_config(m: int, n: int, k: int, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
    """The heuristic's own config for the shape (ragged and whole tiles), with and without bias."""
    x, weight, b = inputs(m, n, k, dtype, device, bias=bias)
    check(x, weight, b, None)


def heuristic_families() -> dict[tuple, tuple[GemvConfig, int]]:
    """Every distinct config the heuristic returns over a grid that crosses each of its thresholds
    (K buckets, row-block halvings, split or not), up to the exact split count: family -> (config, M)."""
    families: dict[tuple, tuple[GemvConfig, int]] = {}
    ns = sorted({v + d for p in range(18) for v in [2**p] for d in (-1, 0, 1) if v + d >= 1} | {3072, 128256})
    ks = sorted({v + d for p in range(15) for v in [2**p] for d in (-1, 0, 1) if v + d >= 1} | {14336})
    for m in range(1, MAX_M + 1):
        for n in ns:
            for k in ks:
                config = default_config(m, n, k)
                rows = 1 if config.use_dot else min(m, 3)  # the kernels differ by the x rows handled
                key = (*config._replace(split_k=min(config.split_k, 2)), rows)
                families.setdefault(key, (config, m))
    return families


FAMILIES = heuristic_families()


@pytest.mark.parametrize(("config", "m"), list(FAMILIES.values()),
                         ids=[f"{c.label()}-m{m}" for c, m in FAMILIES.values()])
def test_every_heuristic_config(config: GemvConfig, m: int, device: torch.device) -> None:
    """Each family on a ragged shape: three row blocks (the last partial), K ending mid-step and,
    for split families, K slices of unequal length."""
    n = 2 * config.block_n + 3
    k = (3 if config.split_k > 1 else 2) * config.block_k - 5
    if config.split_k > 1:
        assert effective_split(k, config.block_k, config.split_k)[0] > 1
    x, weight, b = inputs(m, n, k, torch.bfloat16, device, bias=config.block_k % 128 == 0)
    check(x, weight, b, config)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "k", "config", "bias"), [
    (4, 21, 200, GemvConfig(4, 64, split_k=3), True),  # FMA at its largest M, a partial last slice
    (3, 20, 130, GemvConfig(8, 32, split_k=8, num_warps=2), False),  # padding x row; splits > steps
    (2, 64, 256, GemvConfig(8, 64, num_stages=2), True),  # whole tiles (no masks), pipelined FMA loop
    (1, 40, 300, GemvConfig(32, 64, split_k=4, use_dot=True, num_stages=2, num_warps=8), False),
    (16, 80, 160, GemvConfig(16, 32, split_k=4, use_dot=True), True),  # 5 steps in 4 slices -> 3
    (8, 64, 128, GemvConfig(64, 128, use_dot=True), False),  # whole tiles on the dot path
    # The persistent kernel: 150 row tiles over 132 programs (some walk two), K short of block_k.
    (1, 300, 100, GemvConfig(2, 128, num_stages=2, programs_per_sm=1), True),
    (1, 64, 256, GemvConfig(4, 256, num_stages=3, programs_per_sm=1), False),  # whole tiles: no masks
])
def test_explicit_configs(m: int, n: int, k: int, config: GemvConfig, bias: bool, dtype: torch.dtype,
                          device: torch.device) -> None:
    x, weight, b = inputs(m, n, k, dtype, device, bias=bias)
    check(x, weight, b, config)


@pytest.mark.parametrize("config", [None, GemvConfig(16, 64, split_k=2, use_dot=True)], ids=["default", "dot-split"])
def test_strided_x_and_model_linear(config: GemvConfig | None, device: torch.device) -> None:
    """Rows of x taken from a wider buffer (row stride != K), and the numbers of the model's Linear."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn((3, 160), generator=gen).to(dtype).to(device)
    x = wide[:, 16:116]
    layer = Linear(100, 45, bias=True, dtype=dtype, device=device)
    layer.weight.data.copy_(torch.randn((45, 100), generator=gen) / 10)
    layer.bias.data.copy_(torch.randn(45, generator=gen))
    out = check(x, layer.weight, layer.bias, config)
    assert rel_err(out, layer(x)) <= REL_TOL[dtype]


def test_split_k_is_deterministic(device: torch.device) -> None:
    """Partial sums are combined in a fixed order: repeated calls give identical bits."""
    x, weight, b = inputs(2, 9, 300, torch.bfloat16, device, bias=True)
    config = GemvConfig(4, 64, split_k=5)
    first = gemv(x, weight, b, config=config)
    assert torch.equal(first, gemv(x, weight, b, config=config))


def test_heuristic_choices() -> None:
    """What the heuristic promises: enough programs for the SMs, FMA only at M <= 2, valid tiles,
    no split where the row blocks already fill the GPU, and none of the Llama shapes split at M = 1."""
    for m in (1, 2, 3, 4, 8, 16):
        for n, k in LLAMA_SHAPES + [(1, 1), (7, 5000), (300, 64), (100000, 16)]:
            c = default_config(m, n, k)
            assert c.use_dot == (m > 2)
            assert c.block_k & (c.block_k - 1) == 0 and c.block_n & (c.block_n - 1) == 0
            assert c.block_n * c.block_k <= 4096 or c.use_dot
            splits, _ = effective_split(k, c.block_k, c.split_k)
            assert splits == c.split_k
            programs = -(-n // c.block_n) * c.split_k
            steps = -(-k // c.block_k)
            assert programs >= 2 * H200_SMS or c.split_k == steps
            if -(-n // c.block_n) >= 2 * H200_SMS:
                assert c.split_k == 1
            if m == 1 and (n, k) in LLAMA_SHAPES:
                assert c.split_k == 1 and programs >= 4 * H200_SMS
    assert default_config(1, 2048, 2048, num_sms=8).block_n == 4  # fewer SMs: bigger row blocks
    assert split_for(64, 4096, 16, 256, num_sms=132) > 1


def test_effective_split_covers_k_without_empty_slices() -> None:
    for k in (1, 15, 16, 17, 100, 1000, 4096, 4097):
        for block_k in (16, 64, 256):
            for split in (1, 2, 3, 4, 7, 64):
                splits, per_split = effective_split(k, block_k, split)
                assert 1 <= splits <= split and per_split % block_k == 0
                assert (splits - 1) * per_split < k <= splits * per_split


def test_rejects_bad_inputs(device: torch.device) -> None:
    x = torch.zeros((2, 64), device=device)
    w = torch.zeros((32, 64), device=device)
    with pytest.raises(ValueError, match=r"x must be \[M, K\] and weight \[N, K\]"):
        gemv(x, torch.zeros((32, 63), device=device))
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        gemv(torch.zeros(64, device=device), w)
    with pytest.raises(ValueError, match=r"M \(rows of x\) must be in 1..16"):
        gemv(torch.zeros((MAX_M + 1, 64), device=device), w)
    with pytest.raises(ValueError, match=r"M \(rows of x\) must be in 1..16"):
        gemv(torch.zeros((0, 64), device=device), w)
    with pytest.raises(ValueError, match="one dtype"):
        gemv(x, w.bfloat16())
    with pytest.raises(ValueError, match="one dtype"):
        gemv(x.int(), w.int())
    with pytest.raises(ValueError, match="weight must be contiguous"):
        gemv(x, torch.zeros((64, 32), device=device).t())
    with pytest.raises(ValueError, match="unit stride along K"):
        gemv(torch.zeros((64, 2), device=device).t(), w)
    with pytest.raises(ValueError, match=r"bias must be contiguous \[32\]"):
        gemv(x, w, torch.zeros(31, device=device))
    with pytest.raises(ValueError, match=r"bias must be contiguous \[32\]"):
        gemv(x, w, torch.zeros(32, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out must be contiguous \[2, 32\]"):
        gemv(x, w, out=torch.zeros((2, 33), device=device))
    with pytest.raises(ValueError, match=r"out must be contiguous \[2, 32\]"):
        gemv(x, w, out=torch.zeros((32, 2), device=device).t())
    with pytest.raises(ValueError, match="powers of two"):
        gemv(x, w, config=GemvConfig(3, 64))
    with pytest.raises(ValueError, match="powers of two"):
        gemv(x, w, config=GemvConfig(4, 8))
    with pytest.raises(ValueError, match="dot path needs block_n >= 16"):
        gemv(x, w, config=GemvConfig(8, 64, use_dot=True))
    with pytest.raises(ValueError, match=f"FMA path handles M <= {FMA_MAX_M}"):
        gemv(torch.zeros((FMA_MAX_M + 1, 64), device=device), w, config=GemvConfig(4, 64))
    with pytest.raises(ValueError, match="split_k >= 1"):
        gemv(x, w, config=GemvConfig(4, 64, split_k=0))
    with pytest.raises(ValueError, match="M must be in 1..16"):
        default_config(17, 64, 64)
    # The persistent kernel: one row, its tiles spanning K.
    with pytest.raises(ValueError, match="the persistent kernel takes one row"):
        gemv(x, w, config=GemvConfig(2, 64, programs_per_sm=1))
    with pytest.raises(ValueError, match="block_k covering K"):
        gemv(x[:1], w, config=GemvConfig(2, 32, programs_per_sm=1))
    with pytest.raises(ValueError, match="block_k covering K"):
        gemv(x[:1], w, config=GemvConfig(2, 64, split_k=2, programs_per_sm=1))
    if device.type == "cuda":
        with pytest.raises(ValueError, match="one device"):
            gemv(x, w.cpu())
