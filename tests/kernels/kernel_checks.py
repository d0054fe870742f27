"""Shared helpers of the kernel tests: tolerances, relative error, poisoned outputs, paged KV set-ups."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import NamedTuple, Sequence

import pytest
import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# ‖out − ref‖ / ‖ref‖ bounds: float32 round-off over long sums; half precision rounds every
# stored value (2^-9 for bf16, 2^-12 for fp16) and the attention probabilities once more.
REL_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Shapes equal, every element written (no NaN left from poisoning), relative error in bounds."""
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} elements were never written"
    err = rel_err(out, ref)
    assert err <= REL_TOL[dtype], f"relative error {err:.3g} > {REL_TOL[dtype]:.1g} for {dtype}"


def poisoned(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel fails to write shows up."""
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)


def rounded(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``ref`` stored in ``dtype`` the way a kernel's float32 -> dtype cast does it: to nearest on
    a GPU; triton's interpreter (CPU) truncates float32 -> bfloat16 instead (seen with triton 3.9)."""
    if dtype == torch.bfloat16 and ref.device.type == "cpu":
        return (ref.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return ref.to(dtype)


class PagedKV(NamedTuple):
    """A KV pool layer and request table with each sequence's slots scattered over the pool."""

    k_cache: torch.Tensor  # [num_slots, KVH, D]; slot 0 is the dummy (zeros)
    v_cache: torch.Tensor
    req_to_token: torch.Tensor  # int32 [rows, max_context]
    req_pool_indices: torch.Tensor  # int64 [B]: each sequence's row (not in batch order)


def paged_kv(seq_lens: Sequence[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device, gen: torch.Generator) -> PagedKV:
    """Random K/V for sequences of ``seq_lens`` tokens in random distinct slots >= 1."""
    batch = len(seq_lens)
    num_slots = sum(seq_lens) + 17
    k = torch.randn((num_slots, num_kv_heads, head_dim), generator=gen)
    v = torch.randn((num_slots, num_kv_heads, head_dim), generator=gen)
    k[0] = v[0] = 0
    max_context = max(seq_lens) + 5
    rows = torch.randperm(batch + 3, generator=gen)[:batch]
    table = torch.zeros((batch + 3, max_context), dtype=torch.int32)
    slots = torch.randperm(num_slots - 1, generator=gen) + 1
    used = 0
    for row, n in zip(rows.tolist(), seq_lens):
        table[row, :n] = slots[used : used + n].int()
        used += n
    return PagedKV(k.to(dtype).to(device), v.to(dtype).to(device), table.to(device), rows.to(device))


def reference_attention(q: torch.Tensor, kv: PagedKV, prefix_lens: Sequence[int], extend_lens: Sequence[int],
                        scale: float) -> torch.Tensor:
    """float64 causal attention of packed queries ``[T, H, D]`` over each sequence's paged context."""
    outs = []
    start = 0
    rows = kv.req_pool_indices.tolist()
    for row, prefix, extend in zip(rows, prefix_lens, extend_lens):
        seq_len = prefix + extend
        slots = kv.req_to_token[row, :seq_len].long()
        group = q.shape[1] // kv.k_cache.shape[1]
        keys = kv.k_cache[slots].double().repeat_interleave(group, 1)  # [S, H, D]
        values = kv.v_cache[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("ehd,shd->hes", q[start : start + extend].double(), keys) * scale
        q_pos = prefix + torch.arange(extend, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hes,shd->ehd", probs, values))
        start += extend
    return torch.cat(outs)


# Tiles of a persistent launch (programs_per_sm=1) that leave some programs two or more: 150 over
# the H200's 132 programs on a GPU; under the interpreter, whose programs run one after another,
# 5 over the two programs of few_sms (see sms_for).
PERSISTENT_TILES = 150 if torch.cuda.is_available() else 5


def sms_for(config: object) -> AbstractContextManager[None]:
    """few_sms() for a persistent launch's config (programs_per_sm set), so that a PERSISTENT_TILES
    case still has more tiles than programs under the interpreter; nothing for the others, whose
    heuristics keep the H200's tilings."""
    return few_sms() if getattr(config, "programs_per_sm", 0) else nullcontext()


@contextmanager
def few_sms() -> Iterator[None]:
    """Under the interpreter, the launch heuristics divide the work as for a GPU of two SMs instead
    of the H200's 132: a launch is a few programs instead of hundreds (each interpreted one after
    another), and still more than one, so that work split over programs (row blocks, the fused
    MLP's sums over its programs) stays covered. For the tests that run a whole model through the
    engine; the kernel tests keep the H200's tilings. No effect on a GPU."""
    if torch.cuda.is_available():
        yield
        return
    import app.kernels.triton_gemv as triton_gemv

    heuristic = triton_gemv.device_sms
    with pytest.MonkeyPatch.context() as patch:
        for module in list(sys.modules.values()):  # every module that bound the heuristic's name
            if getattr(module, "__name__", "").startswith("app.") and getattr(module, "device_sms", None) is heuristic:
                patch.setattr(module, "device_sms", lambda _device: 2)
        yield

