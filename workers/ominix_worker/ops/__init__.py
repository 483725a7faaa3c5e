"""Fused elementwise kernels for CUDA (Triton); import only where Triton is available."""
