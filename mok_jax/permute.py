"""Row permutations between token order and expert-sorted order, with deterministic gradients.

Autodiff would transpose a gather into a scatter-add, which is not bitwise repeatable on GPU.
Both permutations here have `custom_vjp`s whose backward is a gather with the inverse
permutation, followed (for the token -> rows direction) by a fixed-order sum over the K slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array


def sum_slots(x_tkd: Array) -> Array:
    """[T, K, D] -> [T, D]: sum over the K slots in slot order 0, 1, ..., K-1, in f32."""
    acc_td = x_tkd[:, 0].astype(jnp.float32)
    for j in range(1, x_tkd.shape[1]):
        acc_td = acc_td + x_tkd[:, j].astype(jnp.float32)
    return acc_td


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tokens_to_rows(x_td: Array, order_n: Array, inverse_n: Array, top_k: int) -> Array:
    """x [T, D] -> rows [N, D] in expert-sorted order: row p is token order_n[p] // K."""
    return x_td[order_n // top_k]


def _tokens_to_rows_fwd(x_td, order_n, inverse_n, top_k):
    return tokens_to_rows(x_td, order_n, inverse_n, top_k), inverse_n


def _tokens_to_rows_bwd(top_k, inverse_n, g_nd):
    g_tkd = g_nd[inverse_n].reshape(-1, top_k, g_nd.shape[-1])
    return sum_slots(g_tkd).astype(g_nd.dtype), None, None


tokens_to_rows.defvjp(_tokens_to_rows_fwd, _tokens_to_rows_bwd)


@jax.custom_vjp
def rows_to_slots(y_nd: Array, order_n: Array, inverse_n: Array) -> Array:
    """rows [N, D] in expert-sorted order -> [N, D] in pair order (pair n = t*K + j)."""
    return y_nd[inverse_n]


def _rows_to_slots_fwd(y_nd, order_n, inverse_n):
    return y_nd[inverse_n], order_n


def _rows_to_slots_bwd(order_n, g_nd):
    return g_nd[order_n], None, None


rows_to_slots.defvjp(_rows_to_slots_fwd, _rows_to_slots_bwd)
