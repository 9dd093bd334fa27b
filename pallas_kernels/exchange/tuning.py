"""The exchange's tuned constants, keyed by device kind as `jax.Device.device_kind` spells them.

The kind is grouped_matmul/tuning.py's `resolve_device_kind`: the device's own when that module's
`DEVICES` knows it, else `TARGET_DEVICE_KIND` (a CPU that lowers or interprets the kernels for
CUDA builds them for it). A kind this table lacks gets the target kind's value.
"""

from __future__ import annotations

import jax

from pallas_kernels.grouped_matmul import tuning as gmm_tuning

# Programs (one a streaming multiprocessor) of an overlapped kernel that run the exchange's
# copies while the others run its GEMM tiles (`MoEOptions.exchange_programs`; 0: the copies in
# kernels of their own). On one H200, at qwen3_30b_a3b's round with an EP > 1 buffer, the
# forward's two kernels took 1.53 ms at 24, 1.66 at 16 and 1.71 as separate kernels
# (bench/results/2026-12-01_exchange_tail_h200/); the layer's backward with the routing, on
# a 1-device mesh, 5.92 ms at 24 and 6.22 separate
# (bench/results/2026-12-01_exchange_backward_return_h200/). Not yet timed on other GPUs.
EXCHANGE_PROGRAMS: dict[str, int] = {"NVIDIA H200": 24}
# The H100 SXM carries the H200's value (the same 132 SMs), not separately measured.
EXCHANGE_PROGRAMS["NVIDIA H100 80GB HBM3"] = EXCHANGE_PROGRAMS["NVIDIA H200"]


def default_exchange_programs(device: jax.Device | None = None) -> int:
    """The table's exchange programs for `device` (default: the first device): its kind's
    value, or the target device kind's where the table has none (module docstring)."""
    kind = gmm_tuning.resolve_device_kind(device)
    return EXCHANGE_PROGRAMS.get(kind, EXCHANGE_PROGRAMS[gmm_tuning.TARGET_DEVICE_KIND])
