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


@jax.custom_vjp
def sum_kept_slots(x_tkd: Array, keep_tk: Array) -> Array:
    """f32 [T, K, D], bool [T, K] -> f32 [T, D]: `sum_slots` of the kept slots, a dropped
    slot adding +0 (whatever it holds: -0, NaN). Its VJP keeps only keep_tk (autodiff of the
    where would keep its [T, K, D] broadcasts for the backward)."""
    return sum_slots(jnp.where(keep_tk[..., None], x_tkd, 0.0))


def _sum_kept_slots_fwd(x_tkd, keep_tk):
    return sum_kept_slots(x_tkd, keep_tk), keep_tk


def _sum_kept_slots_bwd(keep_tk, g_td):
    return jnp.where(keep_tk[..., None], g_td[:, None, :], 0.0), None


sum_kept_slots.defvjp(_sum_kept_slots_fwd, _sum_kept_slots_bwd)


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


@jax.custom_vjp
def take_rows(src_ad: Array, index_b: Array, inverse_a: Array) -> Array:
    """out[b] = src[index_b[b]], or 0 where index_b[b] < 0: a partial permutation of rows.

    The map must be injective on its valid entries, and `inverse_a` its inverse: for each source
    row a, the b with index_b[b] = a, or -1 when no b takes row a. The backward is then the
    gather with the inverse (never a scatter-add), so every row's gradient is a copy.

    Shapes: src [A, D]; index_b int32 [B]; inverse_a int32 [A] -> [B, D].
    """
    return _take(src_ad, index_b)


def _take(src_ad: Array, index_b: Array) -> Array:
    rows_bd = src_ad[jnp.clip(index_b, 0, src_ad.shape[0] - 1)]
    return jnp.where((index_b >= 0)[:, None], rows_bd, jnp.zeros((), src_ad.dtype))


def _take_rows_fwd(src_ad, index_b, inverse_a):
    return _take(src_ad, index_b), inverse_a


def _take_rows_bwd(inverse_a, g_bd):
    return _take(g_bd, inverse_a), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)
