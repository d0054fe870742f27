"""Where and when a kernel's programs ran: each program records its SM and three times.

Why: a kernel's duration in a trace says nothing of how its programs were placed on the SMs or
when each started streaming (a persistent kernel launched as a programmatic dependent can pile
its programs onto the few SMs the kernel before it has freed). Kernels that take a ``probe``
(CUDA only; ``lab/tools/bench_fused_mlp.py --probe``) call :func:`record` once a program, at its end:

    probe[4 p : 4 p + 4] = [SM (%smid), start, end of its PDL wait, end]    (ns of %globaltimer)

``%globaltimer`` is one clock for every SM, so times compare across programs. A kernel that
takes no probe compiles none of this (its ``PROBE`` constexpr is off).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PROBE_FIELDS = 4  # int64 a program: SM, start, end of the wait, end


@triton.jit
def global_ns():
    """The GPU's global timer, ns (``%globaltimer``)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def sm_id():
    """The SM this program runs on (``%smid``)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def record(probe_ptr, program, started, waited):
    """Program ``program``'s record: its SM, ``started``, ``waited`` and now."""
    tl.store(probe_ptr + program * 4, sm_id().to(tl.int64))
    tl.store(probe_ptr + program * 4 + 1, started)
    tl.store(probe_ptr + program * 4 + 2, waited)
    tl.store(probe_ptr + program * 4 + 3, global_ns())


def check_probe(probe: torch.Tensor, programs: int, device: torch.device, kernel: str) -> None:
    """ValueError naming ``kernel`` unless ``probe`` holds ``programs`` records on a CUDA ``device``."""
    if device.type != "cuda":
        raise ValueError(f"{kernel}: probe needs a CUDA device, got {device}")
    if probe.dtype != torch.int64 or not probe.is_contiguous() or probe.numel() < PROBE_FIELDS * programs \
            or probe.device != device:
        raise ValueError(f"{kernel}: probe must be a contiguous int64 buffer of at least {PROBE_FIELDS} x {programs} "
                         f"programs on {device}, got {tuple(probe.shape)} {probe.dtype} on {probe.device}")
