"""The lab's tests: the experiment tools of lab/tools/ run as their users run them, or imported.

lab/tools/ (the tools themselves) and tools/ (the user tools some of them build on) go on
sys.path, as each script's own folder is when it runs. Kernels run on the GPU when there is one,
else under triton's interpreter: ``TRITON_INTERPRET`` is read when a kernel is decorated, so it
is set here, before any test module imports a tool's kernels. Tests marked ``gpu`` are skipped
without a CUDA device.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()

sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "lab" / "tools"))
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
