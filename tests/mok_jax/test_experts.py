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


@pytest.mark.slow
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


# ---------------------------------------------------------------------------------------------
# grouped_swiglu_fused: its residual modes, and the f32 reference.


def _fused_inputs(dtype, top_k=2):
    """Tokens, weights, row scale, a plan (uneven groups, expert 1 empty) and a cotangent, the
    float arrays rounded through `dtype` so that every side sees the same values."""
    from mok_jax.plan import make_plan

    num_tokens, d, f, num_experts = 37, 64, 64, 4
    keys = jax.random.split(jax.random.key(2), 6)
    rng = np.random.default_rng(1)
    experts_tk = np.stack(
        [rng.choice([0, 2, 3], top_k, replace=False, p=[0.6, 0.3, 0.1]) for _ in range(num_tokens)]
    )
    plan = make_plan(jnp.asarray(experts_tk, jnp.int32), num_experts)
    sizes = np.asarray(plan.group_sizes_e)
    assert sizes[1] == 0 and len(set(sizes.tolist())) == num_experts, sizes
    num_rows = num_tokens * top_k
    x = jax.random.normal(keys[0], (num_tokens, d))
    w_gate = jax.random.normal(keys[1], (num_experts, d, f)) / 8
    w_up = jax.random.normal(keys[2], (num_experts, d, f)) / 8
    w_down = jax.random.normal(keys[3], (num_experts, f, d)) / 8
    params = [a.astype(dtype).astype(jnp.float32) for a in (x, w_gate, w_up, w_down)]
    scale = jax.random.uniform(keys[4], (num_rows,), jnp.float32, 0.1, 1.0)
    cotangent = jax.random.normal(keys[5], (num_rows, d))
    return (*params, scale), plan, cotangent


@pytest.mark.slow
@pytest.mark.parametrize("rows", ["copied", "gathered"])
def test_grouped_swiglu_fused_kept_gate_up_give_the_recomputing_backward_bits(rows):
    # residuals "gate_up" hands the backward the forward kernel's gate and up (its f32
    # accumulators rounded to bf16); "inputs" with recompute "gmm" recomputes them and rounds
    # them alike: the same values and gradients, bit for bit, and both the f32 reference's to
    # the bf16 tolerance.
    from mok_jax.experts import grouped_swiglu_fused

    dtype, top_k = canonical_dtype("bfloat16"), 2
    args, plan, cotangent = _fused_inputs(dtype, top_k)

    def fused(residuals):
        def run(x, wg, wu, wd, s):
            return grouped_swiglu_fused(
                x, wg, wu, wd, s, plan.group_sizes_e, plan.order_n, plan.inverse_n, top_k,
                dtype, rows=rows, residuals=residuals, recompute="gmm", interpret=True,
            )  # fmt: skip

        out, vjp = jax.vjp(run, *args)
        return out, vjp(cotangent)

    def reference(x, wg, wu, wd, s):
        x_nd = x[plan.order_n // top_k]
        out = grouped_swiglu_ragged(x_nd, wg, wu, wd, plan.group_sizes_e, jnp.float32)
        return out * s[:, None]

    kept = fused("gate_up")
    chex.assert_trees_all_equal(kept, fused("inputs"))
    expected, expected_vjp = jax.vjp(reference, *args)
    tol = tolerance(dtype)
    names = ["y", "d_x", "d_w_gate", "d_w_up", "d_w_down", "d_scale"]
    for name, got, want in zip(
        names, [kept[0], *kept[1]], [expected, *expected_vjp(cotangent)], strict=True
    ):
        chex.assert_type(got, jnp.float32)
        chex.assert_trees_all_close(
            got, want, rtol=tol.rtol, atol=tol.scaled_atol(want), custom_message=name
        )
