"""Pallas GPU kernels (Mosaic GPU first, Triton-lowered fallbacks). Imports jax and numpy only;
knows nothing of mok_jax or train. One folder per kernel: reference.py, the kernel file(s),
ops.py with the custom_vjp, tuning.py with the tile configs. The grouped-GEMM kernels arrive
with the kernel issue; the layer's "xla" implementation needs none."""
