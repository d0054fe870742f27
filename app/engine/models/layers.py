"""Building blocks of the decoder: parameter-holding layers without initialisation, RMSNorm, rotary.

Parameters are allocated with ``torch.empty`` on the target device and dtype and filled by the
weight loader, so building an 8B model costs no random initialisation and no second copy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from app.engine.model_config import RopeScaling


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with an uninitialised weight ``[out_features, in_features]``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty_param(num_embeddings, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMS normalisation over the last dim, computed in float32 and scaled in the model dtype."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_param(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` (float32), with linear or Llama-3 scaling.

    Llama 3 keeps high frequencies (wavelength below original_len / high_freq_factor), divides low
    ones (wavelength above original_len / low_freq_factor) by ``factor``, and interpolates between.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    # 0 at the low-frequency edge, 1 at the high-frequency edge of the blended band.
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / scaling.low_freq_factor, inv_freq / scaling.factor, blended)
    return torch.where(wavelen < original / scaling.high_freq_factor, inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for a step's positions once; every layer then applies them to q and k."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, *, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling, device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim // 2]`` in ``dtype``, broadcasting over heads."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` in the neox layout: pairs are (i, i + head_dim / 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
