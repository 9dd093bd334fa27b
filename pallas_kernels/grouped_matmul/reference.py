"""The spec of the grouped matmuls in plain JAX, f32 (slow: one masked dense product per group).

Rows [M] are sorted by group: group g owns rows [start_g, start_g + size_g) where start_g is the
exclusive prefix sum of `group_sizes_g`. Rows past sum(group_sizes_g) belong to no group.

  gmm        out[m, :] = lhs[m, :] @ rhs[g(m)]                [M, K] x [G, K, N] -> [M, N]
             (rhs[g(m)].T with transpose_rhs: [G, N, K])     rows of no group -> 0
  tgmm       out[g] = lhs[rows of g].T @ rhs[rows of g]       [M, K] x [M, N] -> [G, K, N]
             (the weight gradient of gmm); empty group -> 0
  gmm_swiglu h[m] = silu(lhs[m] @ w_gate[g]) * (lhs[m] @ w_up[g])   -> [M, F]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array, lax


def group_ids(group_sizes_g: Array, num_rows: int) -> Array:
    """int32 [M]: the group of each row, G for rows past the last group."""
    ends_g = jnp.cumsum(group_sizes_g.astype(jnp.int32))
    return jnp.searchsorted(ends_g, jnp.arange(num_rows, dtype=jnp.int32), side="right").astype(
        jnp.int32
    )


def _dot(a: Array, b: Array) -> Array:
    return jnp.dot(
        a.astype(jnp.float32),
        b.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def gmm(lhs_mk: Array, rhs_gkn: Array, group_sizes_g: Array, *, transpose_rhs: bool = False):
    """f32 [M, N]: each row times its group's matrix (rhs [G, N, K] if transpose_rhs)."""
    if transpose_rhs:
        rhs_gkn = jnp.swapaxes(rhs_gkn, 1, 2)
    num_rows, num_groups = lhs_mk.shape[0], rhs_gkn.shape[0]
    ids_m = group_ids(group_sizes_g, num_rows)

    def add_group(g, out_mn):
        return jnp.where((ids_m == g)[:, None], _dot(lhs_mk, rhs_gkn[g]), out_mn)

    zeros = jnp.zeros((num_rows, rhs_gkn.shape[2]), jnp.float32)
    return lax.fori_loop(0, num_groups, add_group, zeros)


def tgmm(lhs_mk: Array, rhs_mn: Array, group_sizes_g: Array) -> Array:
    """f32 [G, K, N]: per group, its rows of lhs transposed times its rows of rhs."""
    num_groups = group_sizes_g.shape[0]
    ids_m = group_ids(group_sizes_g, lhs_mk.shape[0])

    def one_group(g):
        masked_mk = jnp.where((ids_m == g)[:, None], lhs_mk.astype(jnp.float32), 0.0)
        return _dot(masked_mk.T, rhs_mn)

    return lax.map(one_group, jnp.arange(num_groups, dtype=jnp.int32))


def gmm_swiglu(lhs_mk: Array, w_gate_gkf: Array, w_up_gkf: Array, group_sizes_g: Array) -> Array:
    """f32 [M, F]: silu(gate) * up of each row with its group's weights."""
    gate_mf = gmm(lhs_mk, w_gate_gkf, group_sizes_g)
    up_mf = gmm(lhs_mk, w_up_gkf, group_sizes_g)
    return jax.nn.silu(gate_mf) * up_mf
