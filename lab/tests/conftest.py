"""The lab's tests: the experiment tools of lab/tools/ run as their users run them, or imported.

lab/tools/ (the tools themselves) and tools/ (the user tools some of them build on) go on
sys.path, as each script's own folder is when it runs. Kernels run on the GPU when there is one,
else under triton's interpreter: ``TRITON_INTERPRET`` is read when a kernel is decorated, so it
is set here, before any test module imports a tool's kernels. Tests marked ``gpu`` are skipped
without a CUDA device.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "lab" / "tools"))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))

from device_fixtures import _skip_gpu_tests_without_cuda, device  # noqa: E402, F401  (fixtures; sets TRITON_INTERPRET)
