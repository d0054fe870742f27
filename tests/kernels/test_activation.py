"""SiLU-and-mul against a float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPES, assert_close

from app.kernels.triton_activation import silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 128), (7, 3000), (2, 3, 96)])
def test_silu_and_mul(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """One block; I = 1500 in two column blocks (the second partial); a 3-d input."""
    gen = torch.Generator().manual_seed(shape[-1])
    x = (2 * torch.randn(shape, generator=gen)).to(dtype).to(device)
    out = silu_and_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    assert out.dtype == dtype and out.shape == shape[:-1] + (shape[-1] // 2,)
    assert_close(out, F.silu(gate) * up, dtype)


def test_strided_rows(device: torch.device) -> None:
    """Rows of a wider buffer (e.g. a slice of a larger activation) are read in place."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn((5, 300), generator=gen).to(device)
    x = wide[:, :256]
    gate, up = x.double().chunk(2, dim=-1)
    assert_close(silu_and_mul(x), F.silu(gate) * up, torch.float32)


def test_rejects_bad_inputs(device: torch.device) -> None:
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros((2, 7), device=device))
    with pytest.raises(ValueError, match="unit stride"):
        silu_and_mul(torch.zeros((8, 2), device=device).t())
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        silu_and_mul(torch.zeros((2, 8), dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="do not flatten"):
        silu_and_mul(torch.zeros((4, 3, 8), device=device).transpose(0, 1))
