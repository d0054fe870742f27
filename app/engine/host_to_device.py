"""Host lists to device tensors without blocking the host.

``torch.tensor(values, device="cuda")`` copies from pageable memory with a blocking copy: the
host waits until every step already queued on the device has run. With overlap scheduling a
step is always in flight while the next one is prepared, so such a copy costs a whole step.
Staging the values in pinned memory makes the copy asynchronous; torch's pinned-memory cache
keeps the staging buffer alive until the copy has run on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def tensor_on(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a list, or a list of equal-length lists) as a ``dtype`` tensor on ``device``,
    queued without waiting on a CUDA device."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
