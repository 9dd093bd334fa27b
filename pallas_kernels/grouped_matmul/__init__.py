"""Grouped matmuls of expert-sorted rows: reference.py (the spec), mosaic_gpu.py (forward, dgrad
and fused SwiGLU kernels), mosaic_gpu_wgrad.py (the weight gradient), triton.py (a portable
fallback), ops.py (the custom_vjps), tuning.py (tile configs)."""

from pallas_kernels.grouped_matmul import mosaic_gpu, ops, reference, tuning
from pallas_kernels.grouped_matmul.tuning import TileConfig

__all__ = ["TileConfig", "mosaic_gpu", "ops", "reference", "tuning"]
