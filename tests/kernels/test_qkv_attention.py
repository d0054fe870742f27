"""tools/bench_qkv_attention.py's kernel: its projection stores q and the new token's k and v
where the decode attention reads them (interpreted, small heads); on a GPU its fused path (the
projection's first or last programs of each kv head computing the attention's splits, then stage 2)
equals the projection followed by our decode attention, and leaves its counters at zero."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from bench_qkv_attention import VARIANTS, Step, _qkv_attend_kernel, check  # noqa: E402


def test_projection_stores_q_and_the_new_kv(device: torch.device) -> None:
    k, heads, kv_heads, head_dim, block_n = 64, 4, 2, 16, 4
    rows = (heads + 2 * kv_heads) * head_dim
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(rows, k, generator=gen).to(device)
    x = torch.randn(k, generator=gen).to(device)
    slot = 3
    q = torch.full((heads * head_dim,), float("nan"), device=device)
    k_cache = torch.zeros(5, kv_heads, head_dim, device=device)
    v_cache = torch.zeros_like(k_cache)
    scratch = torch.zeros(1, device=device)
    _qkv_attend_kernel[(rows // block_n,)](
        x, w, q, k_cache, v_cache, torch.zeros(1, dtype=torch.int32, device=device),
        torch.ones(1, dtype=torch.int64, device=device), torch.tensor([slot], device=device), scratch, scratch,
        torch.zeros(2 * kv_heads, dtype=torch.int32, device=device), 1.0, 64,
        K=k, BLOCK_N=block_n, HEAD_DIM=head_dim, NUM_Q_HEADS=heads, NUM_KV_HEADS=kv_heads, GROUP=heads // kv_heads,
        PER_HEAD=(heads // kv_heads + 2) * head_dim // block_n, SPLITS=2, BLOCK_KEYS=16, ATTEND=False)
    want = w.double() @ x.double()
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    assert torch.allclose(q.double(), want[:q_rows], rtol=1e-4, atol=1e-4)
    assert torch.allclose(k_cache[slot].reshape(-1).double(), want[q_rows:q_rows + kv_rows], rtol=1e-4, atol=1e-4)
    assert torch.allclose(v_cache[slot].reshape(-1).double(), want[q_rows + kv_rows:], rtol=1e-4, atol=1e-4)
    others = [s for s in range(5) if s != slot]
    assert int(torch.count_nonzero(k_cache[others])) == 0 and int(torch.count_nonzero(v_cache[others])) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("context", [5, 640, 1152])
def test_fused_splits_equal_the_decode_attention(context: int, device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("the fused path spins on counters: every program must be resident (a GPU)")
    step = Step(context, 2, "cuda")
    for variant in VARIANTS * 2:  # the counters back at zero for the next launch
        assert check(step, *variant) < 2e-2
