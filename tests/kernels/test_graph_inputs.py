"""The decode graph's input kernel (app/kernels/triton_graph_inputs.py) against the torch path of
StaticDecodeInputs.fill: the same static buffers and the same request table after every step."""

from __future__ import annotations

import pytest
import torch

from app.engine.cuda_graph import DUMMY_SLOT, INPUT_IDS, StaticDecodeInputs
from app.engine.kv_pool import ReqToTokenPool
from app.kernels.triton_graph_inputs import load_graph_inputs

# (bs, ids or None for ids on the device, rows, prefix_lens, slots): a large step first, so that
# the smaller ones must overwrite stale rows with padding; rows 0 and 7 live.
STEPS = [
    (16, [5] * 11, list(range(11)), [9] * 11, list(range(100, 111))),
    (4, None, [4, 0, 7], [30, 12, 81], [903, 17, 412]),
    (4, [11, 52, 97, 3], [2, 0, 7, 1], [31, 13, 82, 40], [5, 6, 7, 8]),
    (1, None, [7], [83], [4095]),
    (8, None, [3, 7, 0, 5, 6], [0, 84, 14, 95, 1], [1, 2, 3, 4, 5]),
]


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_fused_fill_equals_the_torch_fill(ids_dtype: torch.dtype, device: torch.device) -> None:
    tables = [ReqToTokenPool(16, 96, device=device) for _ in range(2)]
    for table in tables:
        table.req_to_token[0, 0] = 99  # live: padding (row 0, position 0) must not touch it
    fills = [StaticDecodeInputs(max_bs=16, device=device, fused=fused) for fused in (False, True)]
    assert not fills[0].fused and fills[1].fused
    gen = torch.Generator().manual_seed(0)
    for bs, ids, rows, prefix_lens, slots in STEPS:
        device_ids = torch.randint(0, 1000, (len(rows),), generator=gen, dtype=ids_dtype).to(device)
        for inputs, table in zip(fills, tables):
            inputs.fill(bs, device_ids if ids is None else ids, rows, prefix_lens,
                        torch.tensor(slots, dtype=torch.int64, device=device), table)
        ref, fused = fills
        assert torch.equal(fused.per_seq, ref.per_seq) and torch.equal(fused.out_cache_loc, ref.out_cache_loc)
        assert torch.equal(tables[1].req_to_token, tables[0].req_to_token)
        b = len(rows)
        expected_ids = device_ids.tolist() if ids is None else ids
        assert fused.per_seq[INPUT_IDS, :b].tolist() == expected_ids
        assert fused.out_cache_loc[:bs].tolist() == [*slots, *[DUMMY_SLOT] * (bs - b)]
        assert [int(tables[1].req_to_token[r, p]) for r, p in zip(rows, prefix_lens)] == slots
    assert int(tables[1].req_to_token[0, 0]) == 99


def test_mismatched_inputs_are_refused(device: torch.device) -> None:
    inputs = StaticDecodeInputs(max_bs=8, device=device, fused=True)
    table = ReqToTokenPool(4, 32, device=device)
    slots = torch.tensor([1, 2], dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="load_graph_inputs"):
        load_graph_inputs(inputs.per_seq, None, slots, inputs.out_cache_loc, table.req_to_token, 1)  # b > bs
    with pytest.raises(ValueError, match="load_graph_inputs"):
        load_graph_inputs(inputs.per_seq, slots[:1], slots, inputs.out_cache_loc, table.req_to_token, 2)  # ids of 1
    with pytest.raises(ValueError, match="load_graph_inputs"):
        load_graph_inputs(inputs.per_seq, None, slots, inputs.out_cache_loc[:4], table.req_to_token, 2)


def test_warm_up_fill_leaves_the_live_table_alone(device: torch.device) -> None:
    """The start-up fill (both kernel variants) goes to a scratch table: a live entry stays."""
    table = ReqToTokenPool(4, 32, device=device)
    table.req_to_token[0, 0] = 77
    inputs = StaticDecodeInputs(max_bs=8, device=device, fused=True)
    inputs.warm_up_fill(table)
    assert int(table.req_to_token[0, 0]) == 77 and int(table.req_to_token.count_nonzero()) == 1
    assert inputs.out_cache_loc[0].item() == DUMMY_SLOT
