"""How a kernel launched as a programmatic dependent (PDL) overlaps the kernels around it: the
modes our gemv and fused-MLP launches take, importable without triton (the engine checks
``gemv-pdl-mode`` with them before any kernel loads).

"preload" loads the first weight tile, waits for the kernel before it, then lets the next kernel
start; "wait" waits first, then lets the next kernel start; "late" preloads and waits, and lets the
next kernel start only after its own K loop; "wait-late" waits first and lets the next kernel start
after its K loop.
"""

from __future__ import annotations

GEMV_PDL_MODES = ("preload", "wait", "late", "wait-late")
# The modes in which a kernel that launches plainly (the persistent gemv, the fused MLP kernel) lets the
# next one launch at its programs' start; the late ones let it in after their loop.
EARLY_TRIGGER_MODES = ("preload", "wait")
