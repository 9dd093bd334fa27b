"""Expert compute: the grouped SwiGLU against one dense SwiGLU per group."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax.config import canonical_dtype
from mok_jax.experts import dense_swiglu, grouped_swiglu_ragged
from mok_jax.tolerances import tolerance


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_equals_one_dense_swiglu_per_group(dtype):
    dtype = canonical_dtype(dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    sizes = np.array([5, 0, 17, 1, 9], np.int32)  # an empty group, ragged sizes
    rows = int(sizes.sum()) + 3  # 3 rows beyond every group
    x = jax.random.normal(keys[0], (rows, 64))
    w_gate = jax.random.normal(keys[1], (5, 64, 32)) / 8
    w_up = jax.random.normal(keys[2], (5, 64, 32)) / 8
    w_down = jax.random.normal(keys[3], (5, 32, 64)) / 6
    out = grouped_swiglu_ragged(x, w_gate, w_up, w_down, jnp.asarray(sizes), dtype)
    chex.assert_type(out, jnp.float32)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    expected = [
        dense_swiglu(x[starts[g] : starts[g + 1]], w_gate[g], w_up[g], w_down[g], dtype)
        for g in range(5)
    ]
    expected = jnp.concatenate([*expected, jnp.zeros((3, 64))])
    tol = tolerance(dtype)
    chex.assert_trees_all_close(out, expected, rtol=tol.rtol, atol=tol.scaled_atol(expected))
    chex.assert_trees_all_equal(out[-3:], jnp.zeros((3, 64)))


def test_dense_swiglu_numerics():
    x = jnp.array([[1.0, -2.0]])
    eye = jnp.eye(2)
    out = dense_swiglu(x, eye, eye, eye, canonical_dtype("float32"))
    expected = jax.nn.silu(x) * x
    chex.assert_trees_all_close(out, expected, rtol=1e-6)
