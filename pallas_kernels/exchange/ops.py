"""The exchange's copies as a differentiable op: `send_rows(src, moves, back, round, ...)`.

A copy's gradient is the copy back: the cotangent of the output travels along `back`, the
reverse direction's tables (what each device sends when the roles swap), into the source's
rows. No scatter-add: every destination row has one source (the protocol's invariant 1), so
the reverse is a copy too.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
from jax import Array, lax

from pallas_kernels.exchange import mosaic_gpu, reference
from pallas_kernels.exchange.moves import Moves

Implementation = Literal["auto", "mosaic_gpu", "reference"]


def _send(src_ad, moves, round_index, out_rows, axis_name, implementation):
    run_kernel = functools.partial(mosaic_gpu.send_rows, out_rows=out_rows, axis_name=axis_name)
    run_reference = functools.partial(reference.send_rows, out_rows=out_rows, axis_name=axis_name)
    if implementation == "mosaic_gpu":
        return run_kernel(src_ad, moves, round_index)
    if implementation == "reference":
        return run_reference(src_ad, moves, round_index)
    # "auto": the kernel on GPUs; the all_gather spec on the CPU (Mosaic GPU's interpret mode
    # has no remote refs or semaphores).
    return lax.platform_dependent(src_ad, moves, round_index, cpu=run_reference, default=run_kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def send_rows(
    src_ad: Array,
    moves: Moves,
    back: Moves,
    round_index: Array,
    out_rows: int,
    axis_name: str,
    implementation: Implementation = "auto",
) -> Array:
    """Round `round_index` of one direction of the exchange: src [A, D] -> [out_rows, D], the
    rows every device's `moves` copy to this device, zeros in its zero ranges (inside
    `jax.shard_map` over `axis_name`; other rows are unspecified with the kernel, zeros with
    the reference).

    `back` are the reverse direction's tables (this device's copies from its output rows back
    to the source rows, with its own zero ranges); the gradient travels along them, so the
    gradient of a source row that no copy of the round reads is unspecified with the kernel
    (zero with the reference) unless `back`'s zero ranges cover it. implementation: "auto"
    (the Mosaic GPU kernel on GPUs, the reference on the CPU), "mosaic_gpu" or "reference".
    """
    return _send(src_ad, moves, round_index, out_rows, axis_name, implementation)


def _send_rows_fwd(src_ad, moves, back, round_index, out_rows, axis_name, implementation):
    out = _send(src_ad, moves, round_index, out_rows, axis_name, implementation)
    return out, (back, round_index, src_ad.shape[0])


def _send_rows_bwd(out_rows, axis_name, implementation, residuals, g_od):
    back, round_index, num_rows = residuals
    del out_rows
    g_ad = _send(g_od, back, round_index, num_rows, axis_name, implementation)
    return g_ad, None, None, None


send_rows.defvjp(_send_rows_fwd, _send_rows_bwd)
