"""Which prefill attention runs where: a rule on the model's head shape alone, importable without
triton or flashinfer (the engine resolves ``--attention-backend auto`` with it before either loads)."""

from __future__ import annotations


def packs_query_groups(head_dim: int, group: int, device_type: str) -> bool:
    """Whether our triton prefill attention packs each KV head's query heads into one program (one
    K/V load for the group, 64 // group queries a block) and is then the faster prefill backend.

    H200, bf16, head_dim 64, group 4 (llama-3.2-1b), 11-29: per layer 16 x 512 new tokens 103 ->
    96 us, 4 x 2048 285 -> 258, 2048 after 2048 cached 223 -> 199 (tools/bench_extend_attention.py);
    a prefill step of 16 x 512 took 25.95 ms of device time against flashinfer's 27.01
    (tools/profile_decode.py --phase prefill), and 256 x (512 -> 128) ran 39.95-40.42k out tok/s
    against 38.89-39.38k with flashinfer's prefill (three alternated runs each). At head_dim 128
    (llama-3.1-8b) packing gained nothing (180 us a layer both ways), so flashinfer keeps it.
    """
    return device_type == "cuda" and head_dim <= 64 and group >= 2
