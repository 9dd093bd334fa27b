"""Expert compute: SwiGLU over expert-sorted rows as grouped GEMMs, and the shared experts.

Numerics (every implementation): inputs and weights are cast to the compute dtype, products
accumulate in f32, SwiGLU runs in f32, its output h is cast to the compute dtype for the down
projection, and the down projection's f32 result goes to the combine unrounded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax


def dot_precision(dtype: np.dtype) -> lax.Precision | None:
    """Full precision for f32 compute (no TF32 on GPU); the default for 16-bit inputs."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def swiglu(gate: Array, up: Array) -> Array:
    """silu(gate) * up, in f32."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    return jax.nn.silu(gate) * up


def grouped_swiglu_ragged(
    x_nd: Array,
    w_gate_edf: Array,
    w_up_edf: Array,
    w_down_efd: Array,
    group_sizes_e: Array,
    dtype: np.dtype,
) -> Array:
    """Rows sorted by expert [N, D] -> f32 [N, D], with `jax.lax.ragged_dot`.

    Rows past sum(group_sizes_e) belong to no expert and come out as zeros.
    """
    precision = dot_precision(dtype)

    def grouped(lhs, rhs):
        return lax.ragged_dot(
            lhs.astype(dtype),
            rhs.astype(dtype),
            group_sizes_e,
            precision=precision,
            preferred_element_type=jnp.float32,
        )

    x_nd = x_nd.astype(dtype)
    h_nf = swiglu(grouped(x_nd, w_gate_edf), grouped(x_nd, w_up_edf))
    return grouped(h_nf, w_down_efd)


def dense_swiglu(
    x_td: Array, w_gate_df: Array, w_up_df: Array, w_down_fd: Array, dtype: np.dtype
) -> Array:
    """One SwiGLU applied to every token: x [T, D] -> f32 [T, D] (the shared experts)."""
    precision = dot_precision(dtype)

    def dense(lhs, rhs):
        return jnp.dot(
            lhs.astype(dtype),
            rhs.astype(dtype),
            precision=precision,
            preferred_element_type=jnp.float32,
        )

    h_tf = swiglu(dense(x_td, w_gate_df), dense(x_td, w_up_df))
    return dense(h_tf, w_down_fd)
