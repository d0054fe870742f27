"""Neox rotary on q and k against the model's apply_rotary evaluated in float64."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DTYPES, assert_close, poisoned

from app.engine.models.layers import RotaryEmbedding, apply_rotary as model_rotary
from app.kernels.triton_rotary import apply_rotary, cos_sin_tables


def make_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused qkv output and strided q, k views into it, as the model has them."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn((num_tokens, q_size + 2 * kv_size), generator=gen).to(dtype).to(device)
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k


def reference(x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
    freqs = positions.double()[:, None] * rotary.inv_freq.double()[None, :]
    return model_rotary(x.double(), freqs.cos()[:, None, :], freqs.sin()[:, None, :])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_tokens", "num_heads", "num_kv_heads", "head_dim"),
                         [(1, 4, 4, 64), (13, 8, 2, 128), (40, 32, 8, 64)])
def test_per_token_cos_sin(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                           device: torch.device) -> None:
    """cos/sin as RotaryEmbedding returns them ([T, 1, D/2]), out of place."""
    gen = torch.Generator().manual_seed(num_tokens)
    _, q, k = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, gen)
    rotary = RotaryEmbedding(head_dim, 10_000.0, None, device=device)
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen).to(device)
    cos, sin = rotary(positions, torch.float32)
    q_out, k_out = apply_rotary(q, k, cos, sin)
    assert q_out.is_contiguous() and q_out.dtype == dtype
    assert_close(q_out, reference(q, positions, rotary), dtype)
    assert_close(k_out, reference(k, positions, rotary), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tables_in_place(head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """Tables gathered by position, written in place into the fused qkv buffer; v is left alone."""
    gen = torch.Generator().manual_seed(head_dim)
    qkv, q, k = make_qkv(9, 6, 2, head_dim, dtype, device, gen)
    q_ref_in, k_ref_in, v_before = q.clone(), k.clone(), qkv[:, 8 * head_dim :].clone()
    rotary = RotaryEmbedding(head_dim, 500_000.0, None, device=device)
    tables = cos_sin_tables(rotary.inv_freq, 2048)
    positions = torch.tensor([0, 1, 2, 2047, 5, 6, 1000, 77, 3], device=device, dtype=torch.int32)
    q_out, k_out = apply_rotary(q, k, tables.cos, tables.sin, positions, inplace=True)
    assert q_out is q and k_out is k
    assert_close(q, reference(q_ref_in, positions, rotary), dtype)
    assert_close(k, reference(k_ref_in, positions, rotary), dtype)
    assert torch.equal(qkv[:, 8 * head_dim :], v_before)


def test_every_element_written(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn((5, 3, 64), generator=gen).to(device)
    k = torch.randn((5, 1, 64), generator=gen).to(device)
    q_out, k_out = poisoned(q.shape, q.dtype, device), poisoned(k.shape, k.dtype, device)
    q_out.copy_(q)
    k_out.copy_(k)
    cos, sin = RotaryEmbedding(64, 10_000.0, None, device=device)(torch.arange(5, device=device), torch.float32)
    apply_rotary(q_out, k_out, cos, sin, inplace=True)
    assert not torch.isnan(q_out).any() and not torch.isnan(k_out).any()


def test_rejects_bad_inputs(device: torch.device) -> None:
    q, k = torch.zeros((3, 4, 64), device=device), torch.zeros((3, 2, 64), device=device)
    cos = sin = torch.zeros((3, 32), device=device)
    with pytest.raises(ValueError, match="cos and sin must both be"):
        apply_rotary(q, k, cos[:, :16], sin[:, :16])
    with pytest.raises(ValueError, match="one row per token"):
        apply_rotary(q, k, cos[:2], sin[:2])
    with pytest.raises(ValueError, match="positions must be"):
        apply_rotary(q, k, cos, sin, torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="k must be"):
        apply_rotary(q, torch.zeros((2, 2, 64), device=device), cos, sin)
    with pytest.raises(ValueError, match="even"):
        apply_rotary(torch.zeros((3, 4, 63), device=device), k, cos, sin)
