"""The kernels' probe (app/kernels/triton_probe.py): each program of the row-block gemv records
its SM and its start, the end of its PDL wait and its end, and the results are those of a launch
without it; a probe the kernel cannot take is a clear error. (The fused MLP kernel's probe:
test_fused_mlp.py.)"""

from __future__ import annotations

import pytest
import torch

from app.kernels.triton_gemv import GemvConfig, RotaryStore, device_sms, gemv_add_rms_norm, rows_config
from app.kernels.triton_rotary import cos_sin_tables


def qkv_inputs(device: torch.device, k: int = 256, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 64):
    gen = torch.Generator(device="cpu").manual_seed(5)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    cos, sin = cos_sin_tables(inv_freq, 64)
    caches = [torch.zeros((16, kv_heads, head_dim), device=device, dtype=dtype) for _ in range(2)]
    rot = RotaryStore(cos, sin, torch.tensor([11], device=device), torch.tensor([3], device=device), *caches, q_heads)
    weight = randn((q_heads + 2 * kv_heads) * head_dim, k, scale=k ** -0.5)
    return randn(1, k), randn(1, k), torch.ones(k, device=device, dtype=dtype), weight, rot


def test_a_probe_off_cuda_or_on_another_kernel_is_an_error(device: torch.device) -> None:
    x, residual, norm_w, weight, rot = qkv_inputs(device)
    probe = torch.zeros(4 * weight.shape[0], dtype=torch.int64, device=device)
    if device.type != "cuda":
        with pytest.raises(ValueError, match="gemv_add_rms_norm: probe needs a CUDA device, got cpu"):
            gemv_add_rms_norm(x, residual, norm_w, 1e-5, weight, probe=probe)
    persistent = rows_config(*weight.shape)
    with pytest.raises(ValueError, match="gemv_add_rms_norm: probe takes the row-block FMA kernel, got"):
        gemv_add_rms_norm(x, residual, norm_w, 1e-5, weight, config=persistent, probe=probe)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, "wait"], ids=["plain", "dependent"])
def test_the_gemv_probe_records_each_program(device: torch.device, pdl: bool | str) -> None:
    """The qkv projection with its rotary epilogue, probed: one record a row block (each on a real
    SM, start <= end of the wait < end, all within a few ms), q and the caches bit-equal to the
    launch without the probe; a probe too small for the grid names the programs."""
    x, residual, norm_w, weight, rot = qkv_inputs(device)
    config = GemvConfig(4, 256)
    programs = weight.shape[0] // config.block_n
    probe = torch.zeros(programs + 3, 4, dtype=torch.int64, device=device)
    plain = gemv_add_rms_norm(x, residual, norm_w, 1e-5, weight, config=config, rotary=rot).out.clone()
    caches = [cache.clone() for cache in (rot.k_cache, rot.v_cache)]
    probed = gemv_add_rms_norm(x, residual, norm_w, 1e-5, weight, config=config, rotary=rot, pdl=pdl, probe=probe).out
    torch.cuda.synchronize()
    q_rows = rot.num_q_heads * rot.k_cache.shape[2]
    assert torch.equal(probed[:, :q_rows], plain[:, :q_rows])
    assert torch.equal(rot.k_cache, caches[0]) and torch.equal(rot.v_cache, caches[1])
    ran = probe[:programs].cpu()
    assert int(probe[programs:].abs().sum()) == 0
    assert ((ran[:, 0] >= 0) & (ran[:, 0] < device_sms(device))).all()
    assert ((ran[:, 1] > 0) & (ran[:, 1] <= ran[:, 2]) & (ran[:, 2] < ran[:, 3])).all()
    assert int((ran[:, 3] - ran[:, 1]).max()) < 10_000_000
    with pytest.raises(ValueError, match=f"gemv_add_rms_norm: probe must be a contiguous int64 buffer of at least 4 x "
                                         f"{programs} programs"):
        gemv_add_rms_norm(x, residual, norm_w, 1e-5, weight, config=config, rotary=rot, probe=probe[:2])
