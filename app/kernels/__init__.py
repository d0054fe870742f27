"""Our kernels (triton), and the pure rules their launches follow: tensors and numbers in, tensors
out. Nothing here imports the rest of ``app``; what adapts the engine's batches, pools and graphs
to a kernel lives in ``app/engine`` (the attention backends in ``app/engine/attention``, the fused
decode path in ``app/engine/models/fused_decode.py``). tests/test_layers.py holds this."""
