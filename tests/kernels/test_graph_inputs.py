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


# Steady decode steps (the same rows in the same graph, each a token further, ids on the device)
# advance in place; anything else copies every column again: (bs, ids on the device, rows,
# prefix_lens, advances).
STEADY = [
    (4, True, [3, 1], [10, 20], False),  # the first fill: a copy
    (4, True, [3, 1], [11, 21], True),
    (4, True, [3, 1], [12, 22], True),
    (4, False, [3, 1], [13, 23], False),  # ids from the host
    (4, True, [3, 1], [14, 24], True),
    (4, True, [3, 1], [16, 25], False),  # a row two tokens further
    (4, True, [1, 3], [26, 17], False),  # the same rows in another order
    (8, True, [1, 3], [27, 18], False),  # another graph
    (8, True, [1, 3], [28, 19], True),
    (8, True, [1], [29], False),  # a row left
]


def test_steady_steps_advance_in_place(device: torch.device) -> None:
    """The advancing fill leaves the same static buffers and request table as the torch fill
    that copies every column, step after step; it runs exactly on the steady steps."""
    tables = [ReqToTokenPool(4, 64, device=device) for _ in range(2)]
    ref = StaticDecodeInputs(max_bs=8, device=device, fused=False)
    fused = StaticDecodeInputs(max_bs=8, device=device, fused=True)
    assert not ref.advance and fused.advance  # by default it follows the fused fill
    gen = torch.Generator().manual_seed(4)
    advanced = 0
    for i, (bs, on_device, rows, prefix_lens, advances) in enumerate(STEADY):
        ids = torch.randint(0, 1000, (len(rows),), generator=gen, dtype=torch.int64).to(device)
        slots = torch.tensor([100 + 10 * i + j for j in range(len(rows))], dtype=torch.int64, device=device)
        for inputs, table in zip((ref, fused), tables):
            inputs.fill(bs, ids if on_device else ids.tolist(), rows, prefix_lens, slots, table)
        advanced += advances
        assert fused.advanced_fills == advanced, i
        assert torch.equal(fused.per_seq[:, :bs], ref.per_seq[:, :bs]), i
        assert torch.equal(fused.out_cache_loc[:bs], ref.out_cache_loc[:bs])
        assert torch.equal(tables[1].req_to_token, tables[0].req_to_token)
    with pytest.raises(ValueError, match="advance needs the fused fill"):
        StaticDecodeInputs(max_bs=8, device=device, fused=False, advance=True)


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
    with pytest.raises(ValueError, match=r"load_graph_inputs: .*\(advance: ids on the device\)"):
        load_graph_inputs(inputs.per_seq, None, slots, inputs.out_cache_loc, table.req_to_token, 2, advance=True)


def test_warm_up_fill_leaves_the_live_table_alone(device: torch.device) -> None:
    """The start-up fill (every kernel variant) goes to a scratch table: a live entry stays, and
    the first live fill copies every column."""
    table = ReqToTokenPool(4, 32, device=device)
    table.req_to_token[0, 0] = 77
    inputs = StaticDecodeInputs(max_bs=8, device=device, fused=True)
    inputs.warm_up_fill(table)
    assert int(table.req_to_token[0, 0]) == 77 and int(table.req_to_token.count_nonzero()) == 1
    assert inputs.out_cache_loc[0].item() == DUMMY_SLOT
    assert inputs.advanced_fills == 0 and inputs._last is None
