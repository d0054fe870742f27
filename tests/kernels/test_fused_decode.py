"""The kernels of one-token steps (``fused-decode``) against float64 references on fresh random
inputs: gemv with a SiLU-and-mul prologue, gemv with a residual-add + RMSNorm prologue and its
SiLU-and-mul epilogue (all in triton_gemv.py), and rotary with the KV store (triton_rotary.py).

Outputs are NaN-poisoned (every element must be written); K is mostly not a multiple of the
block, and explicit configs cover whole tiles, split-K with a short last slice and more splits
than steps. The model with these kernels is tested in test_fused_model.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPES, PERSISTENT_TILES, REL_TOL, assert_close, poisoned, rel_err, rounded

from app.kernels.triton_gemv import (
    GemvConfig,
    RotaryStore,
    gemv,
    gemv_add_rms_norm,
    gemv_silu_mul,
    rotary_store_fits,
    silu_out_config,
)
from app.kernels.triton_norm import fused_add_rms_norm, rms_norm
from app.kernels.triton_rotary import apply_rotary, apply_rotary_store_kv, cos_sin_tables

GEMV_CASES = [  # (N, K, config): None is the heuristic's (one K step or several, ragged tails)
    (21, 100, None),
    (13, 1500, None),  # two K steps of 1024, the second partial
    (64, 256, GemvConfig(8, 64)),  # whole tiles: no masks on the weight loads
    (33, 300, GemvConfig(4, 64, split_k=3)),  # split-K, the last slice shorter
    (7, 200, GemvConfig(2, 16, split_k=32, num_warps=2)),  # more splits than steps: 13 slices
    (2 * PERSISTENT_TILES, 100, GemvConfig(2, 128, num_stages=2, programs_per_sm=1)),  # some programs walk two tiles
]
GEMV_IDS = ["default", "default-2steps", "whole-tiles", "split3", "split13", "rows"]


def tensors(gen: torch.Generator, dtype: torch.dtype, device: torch.device, *shapes: tuple[int, ...],
            scale: float = 1.0) -> list[torch.Tensor]:
    return [(torch.randn(shape, generator=gen) * scale).to(dtype).to(device) for shape in shapes]


def linear64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


def assert_accurate(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element written, and the error hardly above that of storing the exact result in the
    dtype (float32 work adds ~1e-7; a missed K step or row would add far more)."""
    assert_close(out, ref, out.dtype)
    rounding = rel_err(rounded(ref, out.dtype), ref)
    assert rel_err(out, ref) <= 1.5 * rounding + 1e-5, (rel_err(out, ref), rounding)


# ---------------------------------------------------------------- down_proj(silu(gate) * up)

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k", "config"), GEMV_CASES, ids=GEMV_IDS)
@pytest.mark.usefixtures("persistent_on_few_sms")
def test_gemv_silu_mul(n: int, k: int, config: GemvConfig | None, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    gate_up, weight, bias = tensors(gen, dtype, device, (1, 2 * k), (n, k), (n,))
    weight /= k**0.5
    out = poisoned((1, n), dtype, device)
    assert gemv_silu_mul(gate_up, weight, bias if k % 2 else None, config=config, out=out) is out
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert_accurate(out, linear64(F.silu(gate) * up, weight, bias if k % 2 else None))


def test_gemv_silu_mul_equals_unfused(device: torch.device) -> None:
    """Within bf16 tolerance of the SiLU-and-mul kernel then gemv (which rounds silu(g) * u)."""
    from app.kernels.triton_activation import silu_and_mul

    gen = torch.Generator().manual_seed(3)
    gate_up, weight = tensors(gen, torch.bfloat16, device, (1, 2 * 300), (40, 300), scale=0.5)
    fused = gemv_silu_mul(gate_up, weight)
    assert rel_err(fused, gemv(silu_and_mul(gate_up), weight)) <= REL_TOL[torch.bfloat16]


# ---------------------------------------------------------------- linear(rms_norm(x + residual))

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize(("n", "k", "config"), GEMV_CASES, ids=GEMV_IDS)
@pytest.mark.usefixtures("persistent_on_few_sms")
def test_gemv_add_rms_norm(n: int, k: int, config: GemvConfig | None, with_residual: bool, dtype: torch.dtype,
                           device: torch.device) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k + with_residual)
    x, residual, norm_weight, weight, bias = tensors(gen, dtype, device, (1, k), (1, k), (k,), (n, k), (n,))
    norm_weight = 1 + norm_weight / 4
    weight /= k**0.5
    eps = 1e-5
    out, res_out = poisoned((1, n), dtype, device), poisoned((1, k), dtype, device)
    result = gemv_add_rms_norm(x, residual if with_residual else None, norm_weight, eps, weight, bias, config=config,
                               out=out, residual_out=res_out)
    assert result.out is out
    if with_residual:
        # The new residual: bit for bit what fused_add_rms_norm stores (the same float32 sum and cast).
        assert result.residual is res_out
        assert torch.equal(res_out, fused_add_rms_norm(x, residual, norm_weight, eps).residual)
        unfused = gemv(fused_add_rms_norm(x, residual, norm_weight, eps).normed, weight, bias)
    else:
        assert result.residual is x and torch.isnan(res_out).all()  # x is the residual; nothing written
        unfused = gemv(rms_norm(x, norm_weight, eps), weight, bias)
    h = result.residual.double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    assert_accurate(out, linear64(normed, weight, bias))
    assert rel_err(out, unfused) <= REL_TOL[dtype]  # the unfused path rounds the normed row too


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k", "config"), GEMV_CASES, ids=GEMV_IDS)
@pytest.mark.usefixtures("persistent_on_few_sms")
def test_gemv_add_rms_norm_reads_the_embedding_row(n: int, k: int, config: GemvConfig | None, dtype: torch.dtype,
                                                   device: torch.device) -> None:
    """``embed_ids``: the input is row ``ids[0]`` of an embedding table, read by the kernel; the
    row is stored as the residual, and the output is bit for bit the lookup's then the kernel's."""
    gen = torch.Generator().manual_seed(n * 1000 + k)
    table, norm_weight, weight, bias = tensors(gen, dtype, device, (37, k), (k,), (n, k), (n,))
    norm_weight = 1 + norm_weight / 4
    weight /= k**0.5
    for token, id_dtype in ((29, torch.int64), (0, torch.int32), (36, torch.int64)):
        ids = torch.tensor([token], dtype=id_dtype, device=device)
        out, res_out = poisoned((1, n), dtype, device), poisoned((1, k), dtype, device)
        result = gemv_add_rms_norm(table, None, norm_weight, 1e-5, weight, bias, config=config, out=out,
                                   residual_out=res_out, embed_ids=ids)
        assert result.out is out and result.residual is res_out
        assert torch.equal(res_out, table[token:token + 1])
        looked_up = gemv_add_rms_norm(table[token:token + 1].clone(), None, norm_weight, 1e-5, weight, bias, config=config)
        assert torch.equal(out, looked_up.out)
    fresh = gemv_add_rms_norm(table, None, norm_weight, 1e-5, weight, bias, config=config, embed_ids=ids)
    assert torch.equal(fresh.residual, table[36:37]) and torch.equal(fresh.out, out)  # residual_out allocated
    with pytest.raises(ValueError, match="embed_ids starts the residual stream: residual must be None"):
        gemv_add_rms_norm(table, table[:1], norm_weight, 1e-5, weight, embed_ids=ids)
    with pytest.raises(ValueError, match="embed_ids must be one int32/int64 id"):
        gemv_add_rms_norm(table, None, norm_weight, 1e-5, weight, embed_ids=ids.float())
    with pytest.raises(ValueError, match="x must be a contiguous embedding table"):
        gemv_add_rms_norm(table.t(), None, norm_weight, 1e-5, weight, embed_ids=ids)


# ------------------------------------------ silu(gate) * up of linear(rms_norm(x + residual))

SILU_OUT_CASES = [  # (N = 2 x intermediate, K, config): None is silu_out_config's
    (42, 100, None),  # 21 pairs: block_n halved to 2 (one pair a program)
    (128, 1500, None),  # two K steps, the second partial
    (64, 256, GemvConfig(8, 64)),  # four pairs a program, whole tiles
    (24, 48, GemvConfig(4, 16, num_warps=2)),  # three K steps
    (4 * PERSISTENT_TILES, 100, GemvConfig(4, 128, num_stages=2, programs_per_sm=1)),  # persistent: tiles of 2 pairs
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k", "config"), SILU_OUT_CASES, ids=["default-odd-pairs", "default-2steps",
                                                                     "n8-whole-tiles", "n4-3steps", "rows"])
@pytest.mark.usefixtures("persistent_on_few_sms")
def test_gemv_add_rms_norm_silu_out(n: int, k: int, config: GemvConfig | None, dtype: torch.dtype,
                                    device: torch.device) -> None:
    """``silu_mul=True``: silu(gate) * up of the gate_up projection, equal bit for bit to the
    unfused kernels in half precision (the projection stored, then the SiLU-and-mul kernel: the
    same rounding of gate and up, the same float32 product; in float32 within a few ulps) and
    close to a float64 reference; the residual as without it."""
    from app.kernels.triton_activation import silu_and_mul

    gen = torch.Generator().manual_seed(n * 100 + k)
    x, residual, norm_weight, weight, bias = tensors(gen, dtype, device, (1, k), (1, k), (k,), (n, k), (n,))
    norm_weight = 1 + norm_weight / 4
    weight /= k**0.5
    for b in (None, bias):
        out, res_out = poisoned((1, n // 2), dtype, device), poisoned((1, k), dtype, device)
        result = gemv_add_rms_norm(x, residual, norm_weight, 1e-5, weight, b, config=config, out=out,
                                   residual_out=res_out, silu_mul=True)
        assert result.out is out and result.residual is res_out
        # Bit for bit against the unfused kernels where both sum in the same order (one config).
        same = config or silu_out_config(n, k)
        projection, plain_residual = gemv_add_rms_norm(x, residual, norm_weight, 1e-5, weight, b, config=same)
        assert torch.equal(res_out, plain_residual)
        fused = gemv_add_rms_norm(x, residual, norm_weight, 1e-5, weight, b, config=same, silu_mul=True).out
        if dtype == torch.float32:  # compiled, the two kernels' float32 SiLU may round differently (ulps)
            assert rel_err(fused, silu_and_mul(projection)) <= 1e-6
        else:
            assert torch.equal(fused, silu_and_mul(projection))
        gate_up = projection.double()
        gate, up = gate_up[:, : n // 2], gate_up[:, n // 2:]
        assert_accurate(out, gate * torch.sigmoid(gate) * up)


def test_silu_out_config_fits_the_llama_shapes() -> None:
    """The default config of the Llama-3 gate_up projections at one row keeps the M = 1 tiling
    (no split, whole pairs a program), on the H200's SM count and on one SM."""
    for hidden, intermediate in ((2048, 8192), (4096, 14336), (3072, 8192)):
        for sms in (132, 1):
            config = silu_out_config(2 * intermediate, hidden, sms)
            assert not config.use_dot and config.split_k == 1 and config.block_n % 2 == 0
            assert intermediate % (config.block_n // 2) == 0
    assert silu_out_config(2 * 8192, 2048) == GemvConfig(4, 1024, 1, False, 4, 1)  # the 1B's: default_config's


# ---------------------------------------------------------------- rotary + KV store

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "q_heads", "kv_heads", "head_dim"), [
    (1, 8, 2, 32),  # one decode token, GQA
    (3, 4, 4, 64),  # several tokens (the kernel is not limited to one)
    (2, 6, 3, 24),  # head_dim 24: half 12 in a block of 16, 3 kv heads in a block of 4
    (1, 32, 8, 64),  # the Llama-3.2-1B attention shape
])
def test_rotary_store_kv(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                         device: torch.device) -> None:
    """q and k rotated in place as apply_rotary rotates them (bit for bit); the caches hold the
    rotated k and the v at each token's slot and nothing anywhere else."""
    gen = torch.Generator().manual_seed(tokens * 100 + head_dim)
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    [qkv] = tensors(gen, dtype, device, (tokens, q_size + 2 * kv_size))
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cos, sin = cos_sin_tables(inv_freq.to(device), 64)
    positions = torch.randperm(64, generator=gen)[:tokens].to(device)
    num_slots = 40
    loc = (torch.randperm(num_slots, generator=gen)[:tokens]).to(device)
    k_cache, v_cache = (poisoned((num_slots, kv_heads, head_dim), dtype, device) for _ in range(2))
    expected = apply_rotary(q, k, cos, sin, positions)  # out of place
    before = qkv.double()

    result = apply_rotary_store_kv(q, k, v, cos, sin, positions, k_cache, v_cache, loc)
    assert result.q is q and result.k is k
    assert torch.equal(q, expected.q) and torch.equal(k, expected.k)
    assert torch.equal(v.double(), before[:, q_size + kv_size:].view(v.shape))  # v untouched
    assert torch.equal(k_cache[loc], expected.k) and torch.equal(v_cache[loc], v)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
    untouched[loc] = False
    assert torch.isnan(k_cache[untouched]).all() and torch.isnan(v_cache[untouched]).all()
    # And the rotation itself, against float64.
    angles = positions.double()[:, None, None] * inv_freq.double().to(device)[None, None, :]
    x1, x2 = before[:, :q_size].view(tokens, q_heads, head_dim).chunk(2, dim=-1)
    ref_q = torch.cat((x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()), dim=-1)
    assert_close(q, ref_q, dtype)


# ---------------------------------------------------------------- qkv projection + rotary + KV store

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim", "hidden", "config", "bias"), [
    (4, 2, 16, 64, GemvConfig(4, 64), False),  # 2 pairs a program, GQA
    (2, 1, 32, 100, GemvConfig(8, 64), True),  # 4 pairs, ragged K, a qkv bias (Qwen2)
    (3, 3, 8, 48, GemvConfig(2, 16), False),  # 1 pair a program, 3 K steps, MHA
    (40, 8, 16, 100, GemvConfig(2, 128, num_stages=2, programs_per_sm=1), True),  # persistent: 224 tiles
    pytest.param(32, 8, 64, 2048, None, False, marks=pytest.mark.gpu),  # Llama-3.2-1B, the default config
    pytest.param(32, 8, 128, 4096, None, True, marks=pytest.mark.gpu),  # Llama-3.1-8B's shape, with a bias
])
def test_qkv_rotary_store(q_heads: int, kv_heads: int, head_dim: int, hidden: int, config: GemvConfig | None, bias: bool,
                          dtype: torch.dtype, device: torch.device) -> None:
    """The norm + qkv gemv with the rotary epilogue against the same gemv stored, then
    apply_rotary_store_kv (the path it replaces): q written into the output's q rows and
    nothing else of the output, k and v in the caches at the token's slot and nowhere else,
    all within the dtype's tolerance of that path (which rounds the projection before rotating)
    and of float64."""
    gen = torch.Generator().manual_seed(q_heads * 100 + head_dim + hidden)
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    n = q_size + 2 * kv_size
    x, residual, norm_weight, weight, b = tensors(gen, dtype, device, (1, hidden), (1, hidden), (hidden,), (n, hidden), (n,))
    norm_weight, weight, b = 1 + norm_weight / 4, weight / hidden**0.5, b if bias else None
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cos, sin = cos_sin_tables(inv_freq.to(device), 64)
    position = torch.tensor([37], device=device)
    loc = torch.tensor([5], device=device)
    num_slots = 9
    k_cache, v_cache = (poisoned((num_slots, kv_heads, head_dim), dtype, device) for _ in range(2))
    out = poisoned((1, n), dtype, device)

    result = gemv_add_rms_norm(x, residual, norm_weight, 1e-5, weight, b, config=config, out=out,
                               rotary=RotaryStore(cos, sin, position, loc, k_cache, v_cache, q_heads))
    assert result.out is out and torch.isnan(out[:, q_size:]).all()  # k and v rows not written

    plain = gemv_add_rms_norm(x, residual, norm_weight, 1e-5, weight, b, config=config)
    assert torch.equal(result.residual, plain.residual)
    q, k, v = (t.view(1, -1, head_dim) for t in plain.out.split([q_size, kv_size, kv_size], dim=-1))
    ref_k, ref_v = (poisoned((num_slots, kv_heads, head_dim), dtype, device) for _ in range(2))
    apply_rotary_store_kv(q, k, v, cos, sin, position, ref_k, ref_v, loc)
    assert rel_err(out[:, :q_size], q.reshape(1, q_size)) <= REL_TOL[dtype]
    assert rel_err(k_cache[loc], ref_k[loc]) <= REL_TOL[dtype]
    assert rel_err(v_cache[loc], ref_v[loc]) <= REL_TOL[dtype]
    others = torch.arange(num_slots, device=device) != loc
    assert torch.isnan(k_cache[others]).all() and torch.isnan(v_cache[others]).all()
    # Against float64: the rotation of the exact projection.
    h = (x.double() + residual.double())
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight.double()
    exact = linear64(normed, weight, b)[0]
    angle = 37 * inv_freq.double().to(device)
    def rotate(heads: torch.Tensor) -> torch.Tensor:
        x1, x2 = heads.chunk(2, dim=-1)
        return torch.cat((x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()), dim=-1)
    assert_close(out[0, :q_size].view(q_heads, head_dim), rotate(exact[:q_size].view(q_heads, head_dim)), dtype)
    assert_close(k_cache[5], rotate(exact[q_size:q_size + kv_size].view(kv_heads, head_dim)), dtype)
    assert_close(v_cache[5], exact[q_size + kv_size:].view(kv_heads, head_dim), dtype)


def test_rotary_store_fits_the_llama_shapes() -> None:
    """The default configs of the Llama-3.2-1B and 3.1-8B qkv projections take the epilogue;
    a tiny projection (one row a program) does not, and asking for it anyway is a clear error."""
    assert rotary_store_fits(32, 8, 64, 2048) and rotary_store_fits(32, 8, 128, 4096)
    assert not rotary_store_fits(4, 2, 16, 64)
    x, w = torch.zeros(1, 64), torch.zeros(128, 64)
    rot = RotaryStore(torch.zeros(8, 8), torch.zeros(8, 8), torch.zeros(1, dtype=torch.int64),
                      torch.zeros(1, dtype=torch.int64), torch.zeros(4, 2, 16), torch.zeros(4, 2, 16), 4)
    with pytest.raises(ValueError, match="the rotary epilogue needs an FMA config without split-K"):
        gemv_add_rms_norm(x, None, torch.ones(64), 1e-5, w, rotary=rot)
    with pytest.raises(ValueError, match=r"weight rows 96 are not \(q heads 4 \+ 2 x 2 kv heads\) x head_dim 16"):
        gemv_add_rms_norm(x, None, torch.ones(64), 1e-5, w[:96], rotary=rot, config=GemvConfig(4, 64))


# ---------------------------------------------------------------- bad inputs

def test_rejects_bad_inputs(device: torch.device) -> None:
    w = torch.zeros((8, 64), device=device)
    with pytest.raises(ValueError, match=r"gemv_silu_mul: gate_up must be \[M, 2K\] and weight \[N, K\]"):
        gemv_silu_mul(torch.zeros((1, 64), device=device), w)
    with pytest.raises(ValueError, match="gemv_silu_mul: the prologue runs on the FMA path"):
        gemv_silu_mul(torch.zeros((2, 128), device=device), w)
    with pytest.raises(ValueError, match="gemv_silu_mul: the prologue runs on the FMA path"):
        gemv_silu_mul(torch.zeros((1, 128), device=device), w, config=GemvConfig(16, 64, use_dot=True))
    x, nw = torch.zeros((1, 64), device=device), torch.ones(64, device=device)
    with pytest.raises(ValueError, match="gemv_add_rms_norm: silu_mul takes one row and an even number of outputs"):
        gemv_add_rms_norm(x, None, nw, 1e-6, torch.zeros((7, 64), device=device), silu_mul=True)
    with pytest.raises(ValueError, match="gemv_add_rms_norm: silu_mul needs an FMA config without split-K"):
        gemv_add_rms_norm(x, None, nw, 1e-6, w, silu_mul=True, config=GemvConfig(2, 16, split_k=2))
    with pytest.raises(ValueError, match="gemv_add_rms_norm: silu_mul needs an FMA config without split-K"):
        gemv_add_rms_norm(x, None, nw, 1e-6, torch.zeros((12, 64), device=device), silu_mul=True,
                          config=GemvConfig(8, 64))  # 6 pairs: block_n / 2 = 4 does not divide them
    with pytest.raises(ValueError, match=r"gemv_add_rms_norm: out must be contiguous \[1, 4\]"):
        gemv_add_rms_norm(x, None, nw, 1e-6, w, silu_mul=True, out=torch.zeros((1, 8), device=device))
    with pytest.raises(ValueError, match=r"gemv_add_rms_norm: x must be one row \[1, K\]"):
        gemv_add_rms_norm(torch.zeros((2, 64), device=device), None, nw, 1e-6, w)
    with pytest.raises(ValueError, match="gemv_add_rms_norm: residual must be"):
        gemv_add_rms_norm(x, torch.zeros((1, 63), device=device), nw, 1e-6, w)
    with pytest.raises(ValueError, match="gemv_add_rms_norm: norm_weight must be"):
        gemv_add_rms_norm(x, None, torch.ones(32, device=device), 1e-6, w)
    with pytest.raises(ValueError, match="gemv_add_rms_norm: eps must be > 0"):
        gemv_add_rms_norm(x, None, nw, 0.0, w)
    with pytest.raises(ValueError, match="gemv_add_rms_norm: residual_out must be"):
        gemv_add_rms_norm(x, x, nw, 1e-6, w, residual_out=torch.zeros((1, 32), device=device))
    with pytest.raises(ValueError, match=r"gemv_add_rms_norm: x and weight must share one dtype"):
        gemv_add_rms_norm(x, None, nw, 1e-6, w.double())
    q, k = torch.zeros((1, 4, 16), device=device), torch.zeros((1, 2, 16), device=device)
    cos, sin = cos_sin_tables(torch.ones(8, device=device), 4)
    pos, loc = torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int64, device=device)
    cache = torch.zeros((4, 2, 16), device=device)
    with pytest.raises(ValueError, match="apply_rotary_store_kv: k_cache and v_cache must be"):
        apply_rotary_store_kv(q, k, k, cos, sin, pos, cache, torch.zeros((4, 1, 16), device=device), loc)
    with pytest.raises(ValueError, match=r"apply_rotary_store_kv: k and v must be \[2, 2, 16\] for 2 slots"):
        apply_rotary_store_kv(q, k, k, cos, sin, pos, cache, cache, torch.zeros(2, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="apply_rotary_store_kv: positions must be int32/int64"):
        apply_rotary_store_kv(q, k, k, cos, sin, pos.float(), cache, cache, loc)
