"""app.engine.host_to_device.tensor_on: host lists to device tensors (pinned staging on CUDA)."""

from __future__ import annotations

import pytest
import torch

from app.engine.host_to_device import tensor_on


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device(request.param)


def test_values_dtypes_and_shapes(device: torch.device) -> None:
    ids = tensor_on([5, 0, 2**40], torch.int64, device)
    assert ids.device.type == device.type and ids.dtype == torch.int64 and ids.tolist() == [5, 0, 2**40]
    flags = tensor_on([True, False], torch.bool, device)
    assert flags.dtype == torch.bool and flags.tolist() == [True, False]
    rows = tensor_on([[1, 2, 3], [4, 5, 6]], torch.int64, device)
    assert rows.shape == (2, 3) and rows.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert tensor_on([0.5, -2.0], torch.float32, device).tolist() == [0.5, -2.0]
    assert tensor_on([], torch.int64, device).numel() == 0


def test_copies_queued_back_to_back_keep_their_own_values(device: torch.device) -> None:
    """Each call stages its own buffer: later calls never overwrite an earlier copy's source."""
    tensors = [tensor_on([i] * 1000, torch.int64, device) for i in range(50)]
    assert [int(t.sum()) for t in tensors] == [1000 * i for i in range(50)]
