"""Which prefill attention runs where: a rule on the model's head shape alone, importable without
triton or flashinfer (the engine resolves ``--attention-backend auto`` with it before either loads)."""

from __future__ import annotations


def packs_query_groups(head_dim: int, group: int, device_type: str) -> bool:
    """Whether our triton prefill attention packs each KV head's query heads into one program (one
    K/V load for the group, 64 // group queries a block) and is then the faster prefill backend.

    Packing pays where a KV head serves several query heads and the heads are small: on the H200
    at head_dim 64, group 4 (llama-3.2-1b) it beat flashinfer's prefill per layer and end to end;
    at head_dim 128 (llama-3.1-8b) it gained nothing, so flashinfer keeps those
    (lab/tools/bench_extend_attention.py; the figures in lab/notes/gpu_notes.md).
    """
    return device_type == "cuda" and head_dim <= 64 and group >= 2
