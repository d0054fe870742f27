"""Kernel tests run on the GPU when there is one, else under triton's interpreter on the CPU.

``TRITON_INTERPRET`` is read when a kernel is decorated (at import of its module), so it is set
here, before any test module imports triton or our kernels. A kernel module that something
imported earlier (with compiled, not interpreted, kernels) is reloaded so that it picks it up.
Tests marked ``gpu`` (large shapes, bf16 model runs) are skipped without a CUDA device.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator

import kernel_checks
import pytest
from device_fixtures import HAS_CUDA, _skip_gpu_tests_without_cuda, device  # noqa: F401  (fixtures; sets TRITON_INTERPRET)

if not HAS_CUDA:
    # Dependency order: the backend module binds names from the kernel modules, so it comes last.
    for _name in ("triton_probe", "triton_kv_store", "triton_norm", "triton_rotary", "triton_activation", "triton_decode",
                  "triton_extend", "triton_greedy", "triton_gemv_epilogues", "triton_gemv_rows", "triton_gemv", "triton_fused_mlp",
                  "triton_graph_inputs", "triton_kv_alloc"):
        if f"app.kernels.{_name}" in sys.modules:
            importlib.reload(sys.modules[f"app.kernels.{_name}"])
    if "app.engine.attention.triton_backend" in sys.modules:
        importlib.reload(sys.modules["app.engine.attention.triton_backend"])


@pytest.fixture
def few_sms() -> Iterator[None]:
    """Launches as for a GPU of two SMs under the interpreter (kernel_checks.few_sms)."""
    with kernel_checks.few_sms():
        yield


@pytest.fixture
def persistent_on_few_sms(request: pytest.FixtureRequest) -> Iterator[None]:
    """For a test parametrized with a launch ``config``: a persistent one (programs_per_sm set)
    launches as for two SMs under the interpreter, so that its PERSISTENT_TILES case still has
    more tiles than programs (kernel_checks.sms_for); the other configs keep the H200's."""
    callspec = getattr(request.node, "callspec", None)
    with kernel_checks.sms_for(callspec.params.get("config") if callspec is not None else None):
        yield
