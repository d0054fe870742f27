"""Attention and fused kernels: torch (reference, CPU), triton, and flashinfer backends."""
