"""Building blocks of the decoder: parameter-holding layers without initialisation, RMSNorm, rotary.

Parameters are allocated with ``torch.empty`` on the target device and dtype and filled by the
weight loader, so building an 8B model costs no random initialisation and no second copy.

The elementwise work (RMSNorm with the residual add, rotary, SiLU-and-mul) runs either as plain
torch ops (the default, and the reference) or through our fused triton kernels when a layer is
given :class:`FusedKernels` (``fused-kernels``). Both paths compute the same function; the
torch path rounds intermediate products to the model dtype where the kernels keep float32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from app.engine.attention import AttendStoredKV
from app.engine.kernel_plan import KernelPlan
from app.engine.kernel_specs import GemvBlockKnobs, GemvPdlRoles, GemvRowRoles, GemvRowsKnobs
from app.engine.model_config import RopeScaling

if TYPE_CHECKING:
    from app.engine.forward_batch import ForwardBatch


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class FusedKernels(NamedTuple):
    """Our triton kernels for the decoder's elementwise work (see app/kernels/triton_*.py)."""

    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    cos_sin_tables: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # apply_rotary_store_kv(q, k, v, cos, sin, positions, k_cache, v_cache, loc): q, k rotated in
    # place and k, v stored in one kernel, for backends that attend over K/V the model stored.
    rotary_store_kv: Callable[..., tuple[torch.Tensor, torch.Tensor]]


def triton_kernels() -> FusedKernels:
    """The fused kernels, imported on demand: triton reads TRITON_INTERPRET when a kernel module
    is imported, and a model on the torch path should not import triton at all."""
    from app.kernels.triton_activation import silu_and_mul
    from app.kernels.triton_norm import fused_add_rms_norm, rms_norm
    from app.kernels.triton_rotary import apply_rotary as triton_apply_rotary
    from app.kernels.triton_rotary import apply_rotary_store_kv, cos_sin_tables

    return FusedKernels(rms_norm, fused_add_rms_norm, triton_apply_rotary, cos_sin_tables, silu_and_mul,
                        apply_rotary_store_kv)


class DecodeKernels(NamedTuple):
    """Fused kernels for steps of one token (``fused-decode``): batch-1 decode in fewer launches.
    See app/kernels/triton_gemv.py (the prologues) and triton_rotary.py."""

    # gemv_add_rms_norm(x, residual, norm_weight, eps, weight, bias) -> (linear(norm(x + residual)), x + residual)
    add_rms_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # gemv_silu_mul(gate_up, weight, bias) -> linear(silu(gate) * up)
    silu_mul_linear: Callable[..., torch.Tensor]
    # apply_rotary_store_kv(q, k, v, cos, sin, positions, k_cache, v_cache, loc): q, k rotated in place, k and v stored
    rotary_store_kv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # fused-qkv-rotary: RotaryStore(cos, sin, positions, loc, k_cache, v_cache, num_q_heads), which
    # add_rms_norm_linear(..., rotary=) takes to rotate and store the qkv projection itself, and
    # rotary_store_fits(num_q_heads, num_kv_heads, head_dim, hidden, device); None: off.
    qkv_rotary_store: Callable[..., Any] | None = None
    qkv_rotary_fits: Callable[..., bool] | None = None
    # fused-silu-out: gemv(act, weight, bias) -> linear(act), the down projection after
    # add_rms_norm_linear(..., silu_mul=True) stored act = silu(gate) * up; None: off.
    linear: Callable[..., torch.Tensor] | None = None
    # gemv-pdl: each gemv's PDL mode ("" = an ordinary launch), passed as pdl= by the model.
    pdl: GemvPdlRoles = GemvPdlRoles()
    # gemv-rows: the roles whose gemv runs persistent, and rows_config(role, n, k, even, max_block_n)
    # -> GemvConfig | None (role_rows_config: the tiling for the shape, as gemv-rows-config changes it).
    rows: GemvRowRoles = GemvRowRoles()
    rows_config: Callable[..., Any] | None = None
    # gemv-config: block_config(role, n, k, even, max_block_n, device) -> GemvConfig | None, the
    # row-block kernel's launch of the roles that do not run persistent (role_block_config).
    block_config: Callable[..., Any] | None = None
    # fused-mlp: fused_mlp(x, residual, norm_weight, eps, gate_up_weight, down_weight_t, out, *, zero,
    # trigger, trigger_at_start) -> (out, x + residual), the whole MLP as one kernel (triton_fused_mlp.py), and
    # fused_mlp_fits(hidden, intermediate); None: off.
    fused_mlp: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    fused_mlp_fits: Callable[..., bool] | None = None

    def config(self, role: str, weight: torch.Tensor, even: bool = False, head_dim: int | None = None) -> Any:
        """The launch config of ``role``'s gemv over ``weight`` (``even``: an epilogue that takes
        row pairs; ``head_dim``: the rotary epilogue's, whose tiles stay within a head): the
        persistent one where gemv-rows names the role and one fits, else the row-block one as
        gemv-config changes it, else None (the kernel's default)."""
        max_block_n = head_dim & -head_dim if head_dim else None  # the largest power of two dividing it
        if self.rows_config is not None and getattr(self.rows, role):
            return self.rows_config(role, weight.shape[0], weight.shape[1], even, max_block_n)
        if self.block_config is not None:
            return self.block_config(role, weight.shape[0], weight.shape[1], even, max_block_n, weight.device)
        return None


def role_rows_config(rows_config: Callable[..., Any], knobs: GemvRowsKnobs | None) -> Callable[..., Any]:
    """``config(role, n, k, even=False, max_block_n=None, device=None)``: ``rows_config``'s persistent tiling
    for an ``[n, k]`` weight (None where none fits), its launch changed as ``knobs``
    (``gemv-rows-config``) says for ``role``. ValueError naming the flag where the change does
    not fit the role's epilogue (odd rows for one that takes row pairs, more rows than a rotary
    head's half-dimension power of two)."""
    by_role = {role: launch.changes() for role, launch in zip(GemvRowsKnobs._fields, knobs or GemvRowsKnobs())}

    def config(role: str, n: int, k: int, even: bool = False, max_block_n: int | None = None,
               device: torch.device | None = None) -> Any:  # device: as role_block_config's (unused)
        base = rows_config(n, k, even, max_block_n)
        changes = by_role[role]
        if base is None or not changes:
            return base
        block_n = changes.get("block_n", base.block_n)
        if (even and block_n % 2) or (max_block_n is not None and block_n > max_block_n):
            raise ValueError(f"gemv-rows-config: {role}'s block_n {block_n} does not fit its epilogue (even rows"
                             f"{f', at most {max_block_n}' if max_block_n else ''})")
        return base._replace(**changes)
    return config


def role_block_config(default_config: Callable[..., Any], device_sms: Callable[[torch.device], int],
                      knobs: GemvBlockKnobs | None) -> Callable[..., Any] | None:
    """``config(role, n, k, even=False, max_block_n=None, device=None)``: the row-block kernel's
    one-row launch for an ``[n, k]`` weight (``default_config`` on the device's SMs) as ``knobs``
    (``gemv-config``) change it for ``role``, or None where they leave the role alone (the kernel
    then picks its default itself). None without knobs. ValueError naming the flag where the
    change does not fit the role's epilogue (as role_rows_config)."""
    by_role = {role: launch.changes() for role, launch in zip(GemvBlockKnobs._fields, knobs or GemvBlockKnobs())}
    if not any(by_role.values()):
        return None

    def config(role: str, n: int, k: int, even: bool = False, max_block_n: int | None = None,
               device: torch.device | None = None) -> Any:
        changes = by_role[role]
        if not changes:
            return None
        base = default_config(1, n, k, device_sms(device or torch.device("cpu")))  # no device: the heuristic's SMs
        launch = base._replace(**changes)
        if (even and launch.block_n % 2) or (max_block_n is not None and launch.block_n > max_block_n):
            raise ValueError(f"gemv-config: {role}'s block_n {launch.block_n} does not fit its epilogue (even rows"
                             f"{f', at most {max_block_n}' if max_block_n else ''})")
        return launch
    return config


def decode_kernels(plan: KernelPlan) -> DecodeKernels:
    """The one-token kernels as ``plan`` has them, imported on demand (as :func:`triton_kernels`):
    each gemv's launch as a programmatic dependent (``gemv_pdl_mode``); the qkv gemv also rotating
    and storing K/V (``fused_qkv_rotary``; the model uses it where it fits); the gate_up gemv
    storing silu(gate) * up so that down is a plain gemv (``fused_silu_out``); the gemv kernels
    that run persistent (``gemv_rows``), launched as ``gemv_rows_knobs`` change rows_config's
    tiling, the others as ``gemv_block_knobs`` change default_config's; the MLP in one kernel
    (``fused_mlp``; the model uses it where it fits), its tuned launch changed by
    ``fused_mlp_knobs`` (ValueError naming the option on a launch the kernel does not take)."""
    from app.kernels.triton_gemv import (
        RotaryStore,
        device_sms,
        default_config,
        gemv,
        gemv_add_rms_norm,
        gemv_silu_mul,
        rotary_store_fits,
        rows_config,
    )
    from app.kernels.triton_fused_mlp import LAUNCH_RULES, FusedMlpConfig, fused_mlp_fits, launchable
    from app.kernels.triton_fused_mlp import fused_mlp as fused_mlp_kernel
    from app.kernels.triton_rotary import apply_rotary_store_kv

    fused_mlp, qkv_rotary = plan.fused_mlp, plan.fused_qkv_rotary
    mlp_config = FusedMlpConfig()._replace(**plan.fused_mlp_knobs.changes())
    if fused_mlp and not launchable(mlp_config):
        raise ValueError(f"fused-mlp-config: {LAUNCH_RULES}, got {mlp_config}")

    return DecodeKernels(
        gemv_add_rms_norm, gemv_silu_mul, apply_rotary_store_kv,
        RotaryStore if qkv_rotary else None, rotary_store_fits if qkv_rotary else None,
        gemv if plan.fused_silu_out else None, GemvPdlRoles.parse(plan.gemv_pdl_mode or "off"), plan.gemv_rows,
        rows_config=role_rows_config(rows_config, plan.gemv_rows_knobs),
        block_config=role_block_config(default_config, device_sms, plan.gemv_block_knobs),
        fused_mlp=functools.partial(fused_mlp_kernel, config=mlp_config) if fused_mlp else None,
        fused_mlp_fits=functools.partial(fused_mlp_fits, config=mlp_config) if fused_mlp else None,
    )


class NormResidual(NamedTuple):
    """What a residual-add + norm returns: the layer's normalised input and the residual stream."""

    normed: torch.Tensor  # norm(x + residual) * weight
    residual: torch.Tensor  # x + residual: what the next add continues from


SmallBatchLinear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# Rows of x up to which the small-batch kernel (triton_gemv) takes over: on the H200 its FMA path
# beats cuBLAS at one row (the 1B model's linear layers: 0.743 vs 0.853 ms per step) and its
# tensor-core path loses at 4 and 16 rows (lab/tools/bench_gemv.py).
SMALL_BATCH_MAX_ROWS = 1


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, small_batch: SmallBatchLinear | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T (+ b)``: through ``small_batch`` (a decode-shaped kernel that streams the weight
    once at full bandwidth) for a contiguous ``x`` of at most SMALL_BATCH_MAX_ROWS rows and a
    contiguous weight (fused-mlp stores down's transposed), else torch's matmul. ``out`` (2-D
    ``x`` only): written and returned; torch's matmul writes it directly (F.linear of a 2-D ``x``
    is this mm), a small-batch result is copied in."""
    small = x.shape[0] <= SMALL_BATCH_MAX_ROWS and x.is_contiguous() and weight.is_contiguous()
    if small_batch is not None and small:
        y = small_batch(x, weight, bias)
        return y if out is None else out.copy_(y)
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with an uninitialised weight ``[out_features, in_features]``.
    ``small_batch``: the kernel for decode-sized inputs (see :func:`linear`); None: torch's."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.small_batch: SmallBatchLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.small_batch)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty_param(num_embeddings, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMS normalisation over the last dim, computed in float32 and scaled in the model dtype
    (torch path) or in float32 (``kernels``: one triton pass, rows of ``x`` may be strided)."""

    def __init__(
        self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device, kernels: FusedKernels | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_param(dim, dtype=dtype, device=device)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> NormResidual:
        """``residual = x + residual`` then ``norm(residual)``; with no residual yet (the first
        layer), ``x`` starts the stream. The sum is rounded to the model dtype before the norm on
        both paths, so fused and unfused models see the same residual stream."""
        if residual is None:
            return NormResidual(self(x), x)
        if self.kernels is not None:
            normed, summed = self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return NormResidual(normed, summed)
        summed = x + residual
        return NormResidual(self(summed), summed)


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


class Rope(NamedTuple):
    """A step's rotary inputs, made once per forward and applied by every layer.

    Torch path: ``cos``/``sin`` ``[T, 1, head_dim/2]`` in the model dtype and ``positions`` None.
    Fused path: float32 tables ``[max_positions, head_dim/2]`` built at load, gathered by the
    kernel at ``positions`` ``[T]``, so a step computes no cos/sin at all.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor | None


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for a step's positions once; every layer then applies them to q and k.

    With ``kernels``, cos/sin tables for positions ``[0, max_positions)`` are built here once and
    the fused kernel rotates q and k in place.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None,
        *,
        device: torch.device,
        kernels: FusedKernels | None = None,
        max_positions: int = 0,  # rows of the fused path's tables; unused on the torch path
    ) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling, device), persistent=False)
        self.kernels = kernels
        if kernels is not None:
            cos, sin = kernels.cos_sin_tables(self.inv_freq, max_positions)
            self.register_buffer("cos_table", cos, persistent=False)
            self.register_buffer("sin_table", sin, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim // 2]`` in ``dtype``, broadcasting over heads."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The step's rotary inputs for tokens at ``positions`` ``[T]`` (below max_positions)."""
        if self.kernels is not None:
            return Rope(self.cos_table, self.sin_table, positions)
        cos, sin = self(positions, dtype)
        return Rope(cos, sin, None)


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, rope: Rope, kernels: FusedKernels | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated q ``[T, Hq, D]`` and k ``[T, Hk, D]`` by the step's ``rope``. The fused path
    rotates in place (one kernel for both): callers pass this step's fresh q and k (views of its
    qkv output, or the q/k norm's outputs), which nothing else reads."""
    if kernels is not None:
        q, k = kernels.apply_rotary(q, k, rope.cos, rope.sin, rope.positions, inplace=True)
        return q, k
    return apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)


def store_kv_and_attend(rotary_store_kv: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        rope: Rope, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
    """Attention of layer ``layer_id``'s new heads on a backend that attends over K/V the model
    stored (:class:`AttendStoredKV`): ``rotary_store_kv`` (apply_rotary_store_kv) rotates q and k
    in place and stores k and v at ``batch.out_cache_loc`` in one kernel, then the backend only
    attends (one kernel fewer a layer than a rotary and the backend's own store)."""
    backend = cast(AttendStoredKV, batch.attn_backend)
    k_cache, v_cache = backend.layer_cache(layer_id)
    rotary_store_kv(q, k, v, rope.cos, rope.sin, rope.positions, k_cache, v_cache, batch.out_cache_loc)
    return backend.attend(q, layer_id, batch)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` in the neox layout: pairs are (i, i + head_dim / 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(gate_up: torch.Tensor, kernels: FusedKernels | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for the fused gate_up projection ``[T, 2 * I]`` (one kernel if fused)."""
    if kernels is not None:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
