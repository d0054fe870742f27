"""TritonAttentionBackend against the torch reference backend: per layer, and through a whole model.

Both backends run the same steps on their own pools: an EXTEND batch (fresh prompts), an EXTEND
batch mixing a prompt that shares another's cached prefix, the next chunk of a chunked prefill and
a one-token extend, then several DECODE steps. The model runs are teacher-forced: the same ids go
through both, and every step's logits must agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from kernel_checks import REL_TOL, assert_close, rel_err

from app.engine.attention import AttentionBackend
from app.engine.forward_batch import ForwardBatch, ForwardMode
from app.engine.kv_pool import KVPool, ReqToTokenPool, SlotAllocator
from app.engine.make_checkpoint import ModelSpec, make_checkpoint
from app.engine.models import CausalLM
from app.engine.weights import load_model
from app.engine.attention.torch_backend import TorchAttentionBackend
from app.kernels.prefill_tiling import packs_query_groups
from app.engine.attention.triton_backend import TritonAttentionBackend

LOGIT_TOL = 1e-4  # float32, relative to the logit scale (as tests/engine/test_models.py)
SPEC = ModelSpec(num_layers=2, hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=2, head_dim=32,
                 vocab_size=1024, max_position_embeddings=512, rope_theta=10_000.0, dtype="float32", seed=5,
                 init_std=0.09)  # about 1/sqrt(hidden): unit-scale activations, peaked attention


def make_backend(kind: str, pool: KVPool, table: ReqToTokenPool, num_heads: int) -> AttentionBackend:
    if kind == "torch":
        return TorchAttentionBackend(pool, table)
    if kind == "flashinfer":
        from app.engine.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(pool, table, num_heads=num_heads)
    # Small splits and blocks so that tiny contexts still take every code path.
    # "triton-one-split": a target of one program caps decode at one split (as large batches are
    # on a GPU): stage 1 writes the output itself. "triton-pack-gqa": prefill programs take a KV
    # head's whole query group (the default on CUDA at head_dim <= 64).
    return TritonAttentionBackend(pool, table, max_kv_splits=4, min_split_len=8, extend_block_m=16, block_n=16,
                                  reduce_in_stage1=kind == "triton-split-reduce",
                                  extend_pack_gqa=kind == "triton-pack-gqa",
                                  target_programs=1 if kind == "triton-one-split" else None)


@dataclass
class Steps:
    """Pools, request table and backend of one run; ``step`` runs one ForwardBatch."""

    allocator: SlotAllocator
    table: ReqToTokenPool
    backend: AttentionBackend

    @classmethod
    def make(cls, kind: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device, num_heads: int | None = None) -> Steps:
        allocator = SlotAllocator(512, device=device)
        pool = KVPool(num_slots=allocator.num_slots, num_layers=num_layers, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, dtype=dtype, device=device)
        table = ReqToTokenPool(8, 256, device=device)
        # Scatter the slots: every other slot of the first 300 stays taken.
        allocator.free(allocator.alloc(300)[::2])
        return cls(allocator, table, make_backend(kind, pool, table, num_heads or num_kv_heads))

    def batch(self, mode: ForwardMode, rows: list[int], prefix_lens: list[int], extend_lens: list[int]) -> ForwardBatch:
        slots = self.allocator.alloc(sum(extend_lens))
        assert slots is not None
        return ForwardBatch.build(mode=mode, req_pool_indices=rows, prefix_lens=prefix_lens, extend_lens=extend_lens,
                                  out_cache_loc=slots, req_to_token_pool=self.table, attn_backend=self.backend)

    def share_prefix(self, src_row: int, dst_row: int, length: int) -> None:
        """Point ``dst_row``'s first ``length`` positions at ``src_row``'s slots, as the radix cache does."""
        self.table.req_to_token[dst_row, :length] = self.table.req_to_token[src_row, :length]


# (mode, rows, prefix_lens, extend_lens); before step 1, row 3 takes row 1's first 20 tokens.
SCHEDULE = [
    (ForwardMode.EXTEND, [0, 1, 2], [0, 0, 0], [5, 30, 47]),
    (ForwardMode.EXTEND, [3, 2, 0], [20, 47, 5], [9, 18, 1]),
    *[(ForwardMode.DECODE, [0, 1, 2, 3], [6 + i, 30 + i, 65 + i, 29 + i], [1, 1, 1, 1]) for i in range(4)],
]


# (q heads a kv head, triton backend): the plain backend at every group; its decode variants, which
# change only how the splits merge, at two groups each; packed prefill at every group.
LAYER_CASES = [*[(group, "triton") for group in (1, 2, 4, 8)],
               (1, "triton-split-reduce"), (8, "triton-split-reduce"), (2, "triton-one-split"), (4, "triton-one-split"),
               *[(group, "triton-pack-gqa") for group in (1, 2, 4, 8)]]


@pytest.mark.parametrize(("group", "kind"), LAYER_CASES)
def test_layer_outputs_match_torch_backend(group: int, kind: str, device: torch.device) -> None:
    """Random q/k/v through both backends' forward over the whole schedule (head_dim 64); the
    triton backend also with its decode splits merged in stage 1 (fused-split-reduce) and
    capped at one split (no merge at all), and with its prefill packing the query groups."""
    num_kv_heads, head_dim = 2, 64
    runs = [Steps.make(name, 1, num_kv_heads, head_dim, torch.float32, device) for name in ("torch", kind)]
    gen = torch.Generator().manual_seed(group)
    for i, (mode, rows, prefix, extend) in enumerate(SCHEDULE):
        if i == 1:
            for run in runs:
                run.share_prefix(1, 3, 20)
        num_tokens = sum(extend)
        q = torch.randn((num_tokens, num_kv_heads * group, head_dim), generator=gen).to(device)
        k, v = (torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(device) for _ in range(2))
        outs = [run.backend.forward(q, k, v, 0, run.batch(mode, rows, prefix, extend)) for run in runs]
        assert_close(outs[1], outs[0], torch.float32)
    backend = runs[1].backend
    assert isinstance(backend, TritonAttentionBackend)
    assert (backend.decode_split_cap(4) == 1) == (kind == "triton-one-split")
    counters = backend._split_counters  # fused-split-reduce's tickets: left zero
    assert (counters is not None) == (kind == "triton-split-reduce") and (counters is None or not counters.any())


def test_decode_split_cap(device: torch.device) -> None:
    """Splits fill the target program count, no more: big batches do not split at all; a batch
    that alone fills at most half the target aims for twice it."""
    pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.float32, device=device)
    table = ReqToTokenPool(2, 8, device=device)
    backend = TritonAttentionBackend(pool, table, max_kv_splits=16, target_programs=32)
    # Pairs of (sequence, kv head): 2 a sequence. Up to 8 sequences (16 pairs, half of 32) aim for 64 programs.
    assert [backend.decode_split_cap(b) for b in (1, 2, 3, 8, 9, 16, 100)] == [16, 16, 11, 4, 2, 1, 1]
    # Programs of 2 warps where a sequence's one split fills the grid, of 4 where it splits.
    assert [backend.decode_num_warps(backend.decode_split_cap(b)) for b in (1, 3, 16, 100)] == [4, 4, 2, 2]
    # Keys a step: 128 (at 4 warps) where a sequence gets at most two splits and the pairs are at
    # most twice the target (up to 32 sequences here), else 64.
    launches = [backend.decode_launch(b, backend.decode_split_cap(b)) for b in (1, 8, 9, 16, 32, 33, 100)]
    assert launches == [(64, 4), (64, 4), (128, 4), (128, 4), (128, 4), (64, 2), (64, 2)]
    # Each key block loads the next block's slots on CUDA (the default there), not elsewhere.
    # So do the splits' slots recorded by layer 0 for the others (step_slots) and stage 2 as stage 1's dependent.
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    pf = (",prefetch_slots,step_slots" if device.type == "cuda" else "") + (",stage2_pdl" if hopper else "")
    assert backend.decode_prefetch_slots == (device.type == "cuda")
    assert backend.decode_tiling() == f"splits=16,min_len=64,block_n=64/128{pf}"
    wide_blocks = TritonAttentionBackend(pool, table, max_kv_splits=16, target_programs=32, block_n=128)
    assert wide_blocks.decode_tiling() == f"splits=16,min_len=64,block_n=128{pf}"  # the rule has one answer there
    # The knobs win at every batch; a head_dim past 64 keeps 64 keys (the rule was measured at 64).
    knobs = TritonAttentionBackend(pool, table, max_kv_splits=16, target_programs=32, decode_block_n=32, decode_warps=8,
                                   decode_prefetch_slots=False, decode_step_slots=False,
                                   decode_stage2_pdl=False)
    if device.type != "cuda":  # programmatic dependent launch: CUDA of compute capability 9.0 or newer only
        with pytest.raises(ValueError, match="decode_stage2_pdl .programmatic dependent launch. needs a CUDA device of "
                                             "compute capability 9.0"):
            TritonAttentionBackend(pool, table, decode_stage2_pdl=True)
    assert [knobs.decode_launch(b, knobs.decode_split_cap(b)) for b in (1, 16, 100)] == [(32, 8)] * 3
    assert knobs.decode_tiling() == "splits=16,min_len=64,block_n=32,warps=8"
    wide = KVPool(num_slots=8, num_layers=1, num_kv_heads=2, head_dim=128, dtype=torch.float32, device=device)
    wide_backend = TritonAttentionBackend(wide, table, max_kv_splits=16, target_programs=32)
    assert wide_backend.decode_launch(16, wide_backend.decode_split_cap(16)) == (64, 2)
    assert wide_backend.decode_tiling() == f"splits=16,min_len=64,block_n=64{pf}"
    # No cap off CUDA (on CUDA the default target is two programs per SM).
    cpu_pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.float32, device="cpu")
    assert TritonAttentionBackend(cpu_pool, table, max_kv_splits=4).decode_split_cap(100) == 4
    # ... and no 128-key rule: its threshold is in programs an SM.
    assert TritonAttentionBackend(cpu_pool, table, max_kv_splits=4).decode_launch(2, 4) == (64, 4)
    with pytest.raises(ValueError, match="target_programs"):
        TritonAttentionBackend(pool, table, target_programs=0)


def test_prefill_tiling_packs_query_groups_on_cuda_at_small_heads(device: torch.device) -> None:
    """Prefill attention packs a KV head's query heads into one program on CUDA at head_dim <= 64
    with grouped heads (16-query blocks at a group of 4, so 64 rows a program), else 64-query
    blocks a head; an explicit choice wins."""
    assert [packs_query_groups(d, g, "cuda") for d, g in ((64, 4), (64, 1), (128, 4), (64, 2))] == [
        True, False, False, True]
    assert not packs_query_groups(64, 4, "cpu")
    table = ReqToTokenPool(2, 8, device=device)
    pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.float32, device=device)
    on_cuda = device.type == "cuda"
    grouped = TritonAttentionBackend(pool, table, num_heads=8)
    assert (grouped.extend_pack_gqa, grouped.extend_block_m) == ((True, 16) if on_cuda else (False, 64))
    unknown_heads = TritonAttentionBackend(pool, table)
    assert (unknown_heads.extend_pack_gqa, unknown_heads.extend_block_m) == (False, 64)
    forced = TritonAttentionBackend(pool, table, num_heads=8, extend_pack_gqa=True)
    assert (forced.extend_pack_gqa, forced.extend_block_m) == (True, 16)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("triton-backend") / "model", SPEC)


def run_model(model: CausalLM, kind: str, device: torch.device, gen_seed: int = 0) -> list[torch.Tensor]:
    """Logits of every new token of every step of SCHEDULE (ids drawn from ``gen_seed``)."""
    cfg = model.config
    run = Steps.make(kind, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, device, cfg.num_heads)
    gen = torch.Generator().manual_seed(gen_seed)
    logits = []
    for i, (mode, rows, prefix, extend) in enumerate(SCHEDULE):
        if i == 1:
            run.share_prefix(1, 3, 20)
        ids = torch.randint(0, cfg.vocab_size, (sum(extend),), generator=gen).to(device)
        batch = run.batch(mode, rows, prefix, extend)
        with torch.inference_mode():
            logits.append(model(ids, batch.positions, batch, all_logits=True).cpu())
    return logits


def test_model_logits_match_torch_backend(tiny_model_dir: Path, device: torch.device) -> None:
    model = load_model(tiny_model_dir, dtype=torch.float32, device=device)
    ref_steps, our_steps = run_model(model, "torch", device), run_model(model, "triton", device)
    for step, (ref, ours) in enumerate(zip(ref_steps, our_steps)):
        scale = max(1.0, ref.abs().max().item())
        diff = (ours - ref).abs().max().item()
        assert diff <= LOGIT_TOL * scale, f"step {step}: max abs diff {diff:.3g} > {LOGIT_TOL} * {scale:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["triton", "flashinfer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_model_logits_match_torch_backend(tiny_model_dir: Path, dtype: torch.dtype, kind: str, device: torch.device) -> None:
    """bf16/fp16 weights: logits agree within half-precision tolerance (norm-relative)."""
    model_dir = tiny_model_dir
    if kind == "flashinfer":
        from app.engine.attention.flashinfer_backend import flashinfer_available

        if not flashinfer_available(device, dtype, 64):
            pytest.skip("flashinfer is not installed here")
        # flashinfer's kernels take head_dim 64, 128 or 256 only (built once, for both dtypes).
        model_dir = tiny_model_dir.parent / "head64"
        if not model_dir.exists():
            make_checkpoint(model_dir, SPEC.replace(head_dim=64))
    model = load_model(model_dir, dtype=dtype, device=device)
    ref_steps, our_steps = run_model(model, "torch", device), run_model(model, kind, device)
    for step, (ref, ours) in enumerate(zip(ref_steps, our_steps)):
        err = rel_err(ours, ref)
        assert err <= REL_TOL[dtype], f"step {step}: relative error {err:.3g} > {REL_TOL[dtype]}"
