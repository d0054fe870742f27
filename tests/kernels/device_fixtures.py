"""What every kernel test folder shares (tests/kernels, lab/tests): the device the kernels run on,
and the rule for tests marked ``gpu``.

Importing this module sets ``TRITON_INTERPRET=1`` without a CUDA device: triton reads it when a
kernel is decorated, so a conftest imports this before any test module imports a kernel. A
conftest exposes the fixtures by importing them.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _skip_gpu_tests_without_cuda(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("gpu") is not None and not HAS_CUDA:
        pytest.skip("needs a CUDA device")


@pytest.fixture
def device() -> torch.device:
    """The device the kernels run on: CUDA when present, else the CPU (interpreted triton)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
