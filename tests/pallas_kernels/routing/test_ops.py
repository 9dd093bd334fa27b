"""The router as a differentiable op (pallas_kernels/routing/ops.py), its kernels in GPU
interpret mode: gradients against the reference's, a token's input gradient the same bits at
any token count and position, the bias and the logits without a gradient."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.routing import ops, reference
from pallas_kernels.routing.reference import RouterSpec
from pallas_kernels.tolerances import tolerance
from tests.pallas_kernels.routing.test_mosaic_gpu import SPECS, TILE, inputs

BF16, F32 = jnp.bfloat16, jnp.float32


def _loss(route_fn, spec: RouterSpec, seed: int = 0):
    """A scalar of every differentiable output, each with its own random weights."""
    keys = jax.random.split(jax.random.key(100 + seed), 3)

    def loss(x, router, bias):
        routed = route_fn(x, router, bias)
        weights = (
            jax.random.normal(keys[0], routed.weights_tk.shape),
            jax.random.normal(keys[1], routed.lse_t.shape),
            jax.random.normal(keys[2], routed.shares_ue.shape),
        )
        outputs = (routed.weights_tk, routed.lse_t, routed.shares_ue)
        return sum(jnp.vdot(w, o) for w, o in zip(weights, outputs, strict=True))

    return loss


def _kernel(spec):
    return lambda x, w, b: ops.route(x, w, b, spec, interpret=True)


def _reference(spec):
    return lambda x, w, b: reference.route(x, w, b, spec, tile=TILE)


@pytest.mark.parametrize(
    "name",
    ["groups", pytest.param("softmax", marks=pytest.mark.slow), "sigmoid_norm_scaled"],
)
def test_gradients_match_the_reference(name):
    spec = SPECS[name]
    x, router, bias = inputs(150, 64, spec.num_experts, seed=4)
    grads = jax.grad(_loss(_kernel(spec), spec), argnums=(0, 1, 2))(x, router, bias)
    want = jax.grad(_loss(_reference(spec), spec), argnums=(0, 1))(x, router, bias)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads[:2], want)
    for got, expected, dtype in ((grads[0], want[0], BF16), (grads[1], want[1], F32)):
        tol = tolerance(F32, dtype)
        expected = np.asarray(expected, np.float32)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), expected, rtol=tol.rtol, atol=tol.scaled_atol(expected)
        )
    chex.assert_trees_all_equal(grads[2], jnp.zeros_like(bias))  # the bias only ranks


def test_a_tokens_input_gradient_does_not_depend_on_the_token_count():
    # The weights' and the lse's cotangents (a token's own; the share sums' reach a whole tile).
    spec = SPECS["groups"]
    x, router, bias = inputs(3 * TILE, 64, spec.num_experts, seed=5)
    keys = jax.random.split(jax.random.key(6))
    cts = (
        jax.random.normal(keys[0], (3 * TILE, spec.top_k)),
        jax.random.normal(keys[1], (3 * TILE,)),
    )

    def dx(rows):
        def outputs(x):
            routed = ops.route(x, router, bias, spec, interpret=True)
            return routed.weights_tk, routed.lse_t

        return jax.vjp(outputs, x[rows])[1](tuple(ct[rows] for ct in cts))[0]

    whole = dx(slice(None))
    chex.assert_trees_all_equal(dx(slice(0, TILE)), whole[:TILE])
    chex.assert_trees_all_equal(dx(slice(7, None)), whole[7:])  # each token 7 rows earlier


def test_the_logits_have_no_gradient():
    spec = SPECS["softmax"]
    x, router, bias = inputs(8, 64, spec.num_experts)

    def logits_sum(x, router):
        return ops.route(x, router, bias, spec, interpret=True).logits_te.sum()

    grads = jax.grad(logits_sum, argnums=(0, 1))(x, router)
    chex.assert_trees_all_equal(grads, (jnp.zeros_like(x), jnp.zeros_like(router)))
