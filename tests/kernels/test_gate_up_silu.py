"""The gate_up projection with SiLU-and-mul in its epilogue (app/kernels/triton_gate_up_silu.py)
against a float64 reference and against the two-kernel path it replaces (the projection, then
triton_activation.silu_and_mul), at small shapes: ragged blocks (masks), whole blocks (none), a
strided x, the launch order's last partial group."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DTYPES

from app.kernels.triton_activation import silu_and_mul
from app.kernels.triton_gate_up_silu import GateUpSiluConfig, gate_up_silu

# ‖out − ref‖ / ‖ref‖ per dtype: the halves are rounded to the dtype before the SiLU.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
SMALL = GateUpSiluConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=2)


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64 gate and up, rounded to the dtype as the stored projection is, then SiLU-and-mul."""
    inter = weight.shape[0] // 2
    both = (x.double() @ weight.double().T).to(x.dtype).double()
    gate, up = both[:, :inter], both[:, inter:]
    return gate / (1 + torch.exp(-gate)) * up


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def inputs(m: int, inter: int, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0
           ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k), generator=gen).to(dtype).to(device)
    weight = (torch.randn((2 * inter, k), generator=gen) * k ** -0.5).to(dtype).to(device)
    return x, weight


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "inter", "k", "config"), [
    (37, 40, 50, SMALL),  # every dim ragged: masks on all loads and the store
    (32, 32, 64, SMALL),  # whole blocks: the unmasked path, 4 K steps
    (80, 16, 16, SMALL._replace(group_m=4)),  # 5 block rows in groups of 4: a last group of one
    (20, 48, 40, SMALL._replace(block_n=32, block_k=32, num_stages=1)),
])
def test_matches_the_reference_and_the_two_kernels(m: int, inter: int, k: int, config: GateUpSiluConfig,
                                                   dtype: torch.dtype, device: torch.device) -> None:
    x, weight = inputs(m, inter, k, dtype, device)
    out = torch.full((m, inter), float("nan"), dtype=dtype, device=device)  # poisoned: every element written
    got = gate_up_silu(x, weight, config=config, out=out)
    assert got is out and not torch.isnan(out).any()
    ref = reference(x, weight)
    assert rel_err(out, ref) <= REL_TOL[dtype]
    two_kernels = silu_and_mul(x @ weight.T)
    assert rel_err(out, two_kernels.double()) <= REL_TOL[dtype]


def test_strided_x_and_empty_shapes(device: torch.device) -> None:
    """Rows of x taken from a wider buffer; no rows, no outputs and K = 0 give what they should."""
    dtype = torch.float32
    wide, weight = inputs(24, 20, 72, dtype, device, seed=3)
    x = wide[:, 8:40]
    weight = weight[:, :32].contiguous()
    assert rel_err(gate_up_silu(x, weight, config=SMALL), reference(x, weight)) <= REL_TOL[dtype]
    assert gate_up_silu(x[:0], weight, config=SMALL).shape == (0, 20)
    assert gate_up_silu(x, weight[:0], config=SMALL).shape == (24, 0)
    zeros = gate_up_silu(torch.empty((3, 0), device=device), torch.empty((8, 0), device=device), config=SMALL)
    assert torch.equal(zeros, torch.zeros((3, 4), device=device))


def test_rejects_bad_inputs(device: torch.device) -> None:
    x, weight = inputs(4, 16, 32, torch.float32, device)
    with pytest.raises(ValueError, match=r"x must be \[M, K\] and weight \[2I, K\]"):
        gate_up_silu(x, weight[:, :16])
    with pytest.raises(ValueError, match=r"x must be \[M, K\] and weight \[2I, K\]"):
        gate_up_silu(x, weight[:31])
    with pytest.raises(ValueError, match="one dtype"):
        gate_up_silu(x, weight.bfloat16())
    with pytest.raises(ValueError, match="one dtype"):
        gate_up_silu(x.int(), weight.int())
    with pytest.raises(ValueError, match="weight must be contiguous"):
        gate_up_silu(x, weight.T.contiguous().T)
    with pytest.raises(ValueError, match="unit stride along K"):
        gate_up_silu(x.T.contiguous().T, weight)
    with pytest.raises(ValueError, match=r"out must be contiguous \[4, 16\]"):
        gate_up_silu(x, weight, out=torch.empty((4, 17), device=device))
    with pytest.raises(ValueError, match="blocks must be powers of two >= 16"):
        gate_up_silu(x, weight, config=SMALL._replace(block_k=24))
    with pytest.raises(ValueError, match="blocks must be powers of two >= 16"):
        gate_up_silu(x, weight, config=SMALL._replace(block_m=8))
