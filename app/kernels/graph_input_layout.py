"""The layout of a decode graph's static per-sequence inputs, as the graph-inputs kernel
(triton_graph_inputs.py) reads them and the graph runner (app/engine/cuda_graph.py) fills them;
importable without triton.

``per_seq`` is one ``[4, width]`` int64 buffer whose rows are the columns below, so that one
host-to-device copy fills a step.
"""

from __future__ import annotations

# Rows of the static per-sequence buffer.
INPUT_IDS, REQ_POOL_INDICES, POSITIONS, SEQ_LENS = range(4)
DUMMY_SLOT = 0  # the KV pool's reserved slot (see app/engine/kv_pool.py): padded tokens write their K/V there
