"""RMSNorm and fused residual-add + RMSNorm against float64 references and the model's own RMSNorm."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DTYPES, REL_TOL, assert_close, rel_err

from app.engine.models.layers import RMSNorm
from app.kernels.triton_norm import fused_add_rms_norm, rms_norm

EPS = 1e-6


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "max_block"), [((1, 64), 8192), ((5, 4096), 8192), ((3, 200), 64), ((7,), 8192)])
def test_rms_norm(shape: tuple[int, ...], max_block: int, dtype: torch.dtype, device: torch.device) -> None:
    """One-pass rows, a wide row, a non-power-of-two row in two passes (max_block 64), a 1-d input."""
    gen = torch.Generator().manual_seed(shape[-1])
    x = (3 * torch.randn(shape, generator=gen)).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)
    out = rms_norm(x, weight, EPS, max_block=max_block)
    assert out.dtype == dtype and out.is_contiguous()
    assert_close(out, reference(x, weight), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_strided_heads_matches_model(dtype: torch.dtype, device: torch.device) -> None:
    """Qwen3's per-head q norm on a strided view of a fused qkv output, against layers.RMSNorm."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn((6, 8 * 128 + 2 * 2 * 128), generator=gen).to(dtype).to(device)
    q = qkv[:, : 8 * 128].view(6, 8, 128)
    layer = RMSNorm(128, EPS, dtype=dtype, device=device)
    layer.weight.data.copy_(1 + 0.1 * torch.randn(128, generator=gen))
    out = rms_norm(q, layer.weight, EPS)
    assert_close(out, reference(q, layer.weight), dtype)
    assert rel_err(out, layer(q)) <= REL_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "max_block"), [((1, 64), 8192), ((9, 2048), 8192), ((4, 300), 128)])
def test_fused_add_rms_norm(shape: tuple[int, ...], max_block: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(shape[0])
    x, residual = (torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS, max_block=max_block)
    summed = x.double() + residual.double()
    assert_close(new_residual, summed, dtype)
    # The sum is rounded to the residual dtype before it is normalised, as in the unfused model.
    assert_close(normed, reference(new_residual, weight), dtype)
    assert rel_err(normed, reference(summed, weight)) <= REL_TOL[dtype]


def test_rejects_bad_inputs(device: torch.device) -> None:
    x = torch.zeros((2, 64), device=device)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        rms_norm(x, torch.ones(32, device=device), EPS)
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm(x.t(), torch.ones(2, device=device), EPS)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, torch.ones(64, device=device), 0.0)
    with pytest.raises(ValueError, match="residual must match"):
        fused_add_rms_norm(x, torch.zeros((3, 64), device=device), torch.ones(64, device=device), EPS)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        rms_norm(x.int(), torch.ones(64, device=device), EPS)
