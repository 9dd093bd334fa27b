"""The plan's invariants as properties (see mok_jax/plan.py)."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from mok_jax.plan import make_plan


@st.composite
def routings(draw):
    """experts [T, K] (distinct per token, or not: the plan must not care), E, capacity."""
    num_experts = draw(st.integers(1, 9))
    num_tokens = draw(st.integers(1, 12))
    top_k = draw(st.integers(1, 4))
    experts = draw(
        hnp.arrays(np.int32, (num_tokens, top_k), elements=st.integers(0, num_experts - 1))
    )
    capacity = draw(st.none() | st.integers(0, num_tokens * top_k))
    return experts, num_experts, capacity


@given(routings())
def test_plan_invariants(routing):
    experts, num_experts, capacity = routing
    plan = make_plan(jnp.asarray(experts), num_experts, capacity)
    order, inverse = np.asarray(plan.order_n), np.asarray(plan.inverse_n)
    sizes, starts = np.asarray(plan.group_sizes_e), np.asarray(plan.group_starts_e)
    flat = experts.reshape(-1)
    num_rows = flat.size
    # 1. every (token, slot) appears exactly once, and inverse inverts order.
    assert sorted(order) == list(range(num_rows))
    np.testing.assert_array_equal(order[inverse], np.arange(num_rows))
    np.testing.assert_array_equal(inverse[order], np.arange(num_rows))
    # 2. sorted by expert; within an expert by pair index (global token, then slot).
    np.testing.assert_array_equal(order, sorted(range(num_rows), key=lambda n: (flat[n], n)))
    # 3. group sizes count the routed rows and sum to T*K; starts are their prefix sums.
    np.testing.assert_array_equal(sizes, np.bincount(flat, minlength=num_experts))
    assert sizes.sum() == num_rows
    np.testing.assert_array_equal(starts, np.concatenate([[0], np.cumsum(sizes)[:-1]]))
    # 4. capacity keeps each expert's first C rows in pair order and counts the rest.
    if capacity is None:
        assert plan.keep_n is None and int(plan.dropped) == 0
        return
    seen = np.zeros(num_experts, int)
    expected_keep = []
    for e in flat:
        expected_keep.append(seen[e] < capacity)
        seen[e] += 1
    np.testing.assert_array_equal(np.asarray(plan.keep_n), expected_keep)
    assert int(plan.dropped) == num_rows - sum(expected_keep)


def test_plan_dtypes_and_shapes():
    plan = make_plan(jnp.array([[1, 0], [1, 2]]), 4)
    for field in (plan.order_n, plan.inverse_n, plan.group_sizes_e, plan.group_starts_e):
        assert field.dtype == jnp.int32
    np.testing.assert_array_equal(plan.group_sizes_e, [1, 2, 1, 0])
    np.testing.assert_array_equal(plan.order_n, [1, 0, 2, 3])


def test_plan_runs_no_loop():
    # Every step of a while loop is a GPU launch; the plan's searches are unrolled.
    experts = jnp.zeros((64, 2), jnp.int32)
    compiled = jax.jit(lambda e: make_plan(e, 8, capacity=4)).lower(experts).compile()
    assert " while(" not in compiled.as_text()
