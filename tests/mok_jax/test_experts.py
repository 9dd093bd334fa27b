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


# ---------------------------------------------------------------------------------------------
# grouped_swiglu_pallas (Mosaic GPU kernels, GPU interpret mode here) against the ragged one.


def _pallas_inputs(dtype):
    keys = jax.random.split(jax.random.key(1), 6)
    sizes = np.array([50, 0, 67, 1], np.int32)  # an empty group, partial tiles
    rows = int(sizes.sum()) + 5  # 5 rows beyond every group
    d, f = 128, 128
    x = jax.random.normal(keys[0], (rows, d))
    w_gate = jax.random.normal(keys[1], (4, d, f)) / 8
    w_up = jax.random.normal(keys[2], (4, d, f)) / 8
    w_down = jax.random.normal(keys[3], (4, f, d)) / 8
    weights = jax.random.uniform(keys[4], (rows,), jnp.float32)
    cotangent = jax.random.normal(keys[5], (rows, d))
    # Both sides see the same rounded inputs.
    params = [a.astype(dtype).astype(jnp.float32) for a in (x, w_gate, w_up, w_down)]
    return params, weights, jnp.asarray(sizes), cotangent


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_grouped_swiglu_pallas_matches_ragged(weighted):
    from mok_jax.experts import grouped_swiglu_pallas

    dtype = canonical_dtype("bfloat16")
    params, weights, sizes, cotangent = _pallas_inputs(dtype)

    def pallas(x, wg, wu, wd, w):
        return grouped_swiglu_pallas(
            x, wg, wu, wd, sizes, dtype, weights_n=w if weighted else None, interpret=True
        )

    def ragged(x, wg, wu, wd, w):
        out = grouped_swiglu_ragged(x, wg, wu, wd, sizes, dtype)
        return out * w[:, None] if weighted else out

    args = (*params, weights)
    out, vjp = jax.vjp(pallas, *args)
    expected, expected_vjp = jax.vjp(ragged, *args)
    chex.assert_type(out, jnp.float32)
    tol = tolerance(dtype)
    chex.assert_trees_all_close(out, expected, rtol=tol.rtol, atol=tol.scaled_atol(expected))
    chex.assert_trees_all_equal(out[-5:], jnp.zeros((5, out.shape[1])))
    grads, expected_grads = vjp(cotangent), expected_vjp(cotangent)
    names = ["x", "w_gate", "w_up", "w_down", "weights"][: 5 if weighted else 4]
    for name, g, e in zip(names, grads, expected_grads, strict=False):
        chex.assert_trees_all_close(
            g, e, rtol=tol.rtol, atol=tol.scaled_atol(e), custom_message=f"d_{name}"
        )


def test_grouped_swiglu_pallas_needs_a_16_bit_dtype():
    from mok_jax.experts import grouped_swiglu_pallas

    params, _, sizes, _ = _pallas_inputs(canonical_dtype("bfloat16"))
    with pytest.raises(ValueError, match="dtype=float32 must be bfloat16 or float16"):
        grouped_swiglu_pallas(*params, sizes, canonical_dtype("float32"), interpret=True)


def test_grouped_swiglu_fused_names_a_bad_rows_mode():
    from mok_jax.experts import grouped_swiglu_fused

    (x, *weights), _, sizes, _ = _pallas_inputs(canonical_dtype("bfloat16"))
    order = jnp.arange(x.shape[0], dtype=jnp.int32)
    scale = jnp.ones(x.shape[0], jnp.float32)
    with pytest.raises(ValueError, match="rows='both' must be one of"):
        grouped_swiglu_fused(
            x, *weights, scale, sizes, order, order, 1, canonical_dtype("bfloat16"), rows="both"
        )
    with pytest.raises(ValueError, match="recompute='xla' must be one of"):
        grouped_swiglu_fused(
            x, *weights, scale, sizes, order, order, 1, canonical_dtype("bfloat16"), recompute="xla"
        )
