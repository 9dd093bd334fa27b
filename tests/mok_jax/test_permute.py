"""The permutations' custom VJPs equal autodiff's gradients, without its scatter-adds."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax.permute import rows_to_slots, sum_kept_slots, sum_slots, tokens_to_rows
from mok_jax.plan import make_plan


@pytest.fixture
def case():
    experts = jax.random.randint(jax.random.key(0), (13, 3), 0, 5)
    plan = make_plan(experts, 5)
    x = jax.random.normal(jax.random.key(1), (13, 16))
    rows = jax.random.normal(jax.random.key(2), (39, 16))
    return plan, x, rows


def test_tokens_to_rows(case):
    plan, x, _ = case
    rows = tokens_to_rows(x, plan.order_n, plan.inverse_n, 3)
    chex.assert_trees_all_equal(rows, x[plan.order_n // 3])
    cotangent = jax.random.normal(jax.random.key(3), rows.shape)

    def custom(x):
        return jnp.vdot(tokens_to_rows(x, plan.order_n, plan.inverse_n, 3), cotangent)

    # Token t's gradient: its three rows' cotangents, summed in slot order.
    by_slot = np.asarray(cotangent)[np.asarray(plan.inverse_n)].reshape(13, 3, 16)
    expected = (by_slot[:, 0] + by_slot[:, 1]) + by_slot[:, 2]
    chex.assert_trees_all_equal(jax.grad(custom)(x), jnp.asarray(expected))


def test_rows_to_slots(case):
    plan, _, rows = case
    cotangent = jax.random.normal(jax.random.key(4), rows.shape)
    slots = rows_to_slots(rows, plan.order_n, plan.inverse_n)
    chex.assert_trees_all_equal(slots, rows[plan.inverse_n])

    def custom(r):
        return jnp.vdot(rows_to_slots(r, plan.order_n, plan.inverse_n), cotangent)

    chex.assert_trees_all_equal(jax.grad(custom)(rows), cotangent[plan.order_n])


def test_sum_slots_is_left_to_right_in_f32():
    x = jnp.array([[[1.0], [2.0**-9], [2.0**-9]]], jnp.bfloat16)  # below bf16 resolution at 1
    out = sum_slots(x)
    chex.assert_type(out, jnp.float32)
    np.testing.assert_array_equal(out, [[1.0 + 2.0**-8]])


def test_sum_kept_slots_values_gradient_and_residuals():
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (6, 3, 8))
    x = x.at[1, 2].set(jnp.nan).at[2].set(-0.0)  # a dropped slot holding NaN; -0 rows
    keep = jax.random.bernoulli(keys[1], 0.6, (6, 3)).at[1, 2].set(False).at[2].set(False)
    g = jax.random.normal(keys[2], (6, 8))

    def autodiff(x):
        return sum_slots(jnp.where(keep[..., None], x, 0.0))

    out, vjp = jax.vjp(lambda x: sum_kept_slots(x, keep), x)
    expected, expected_vjp = jax.vjp(autodiff, x)
    chex.assert_trees_all_equal(out, expected)
    assert not np.signbit(np.asarray(out[2])).any()  # a token with no kept slot: +0
    chex.assert_trees_all_equal(vjp(g), expected_vjp(g))
    # Only the [T, K] mask is kept for the backward (autodiff keeps [T, K, D] broadcasts).
    saved = jax.vjp(lambda x: sum_kept_slots(x, keep), x)[1]
    shapes = [leaf.shape for leaf in jax.tree.leaves(saved)]
    assert (6, 3) in shapes and (6, 3, 8) not in shapes, shapes
