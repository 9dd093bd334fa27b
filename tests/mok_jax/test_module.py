"""The Flax NNX module: same function as `moe`, trainable weights vs the router-bias state."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from mok_jax import MoE, MoEParams, RouterBias, moe
from tests.mok_jax.cases import SCALED_PRESETS


@pytest.mark.slow
def test_module_computes_moe():
    cfg = SCALED_PRESETS["deepseek_v3"]
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    assert isinstance(layer.params, MoEParams)
    x = jax.random.normal(jax.random.key(1), (3, 5, cfg.d_model), jnp.bfloat16)
    y, aux = layer(x)
    y_fn, aux_fn = moe(x, layer.params, cfg)
    chex.assert_trees_all_equal((y, aux), (y_fn, aux_fn))
    chex.assert_shape(y, x.shape)


def test_shared_experts_only_when_configured():
    assert MoE(SCALED_PRESETS["tiny"], rngs=nnx.Rngs(0)).shared_w_gate is None
    layer = MoE(SCALED_PRESETS["deepseek_v3"], rngs=nnx.Rngs(0))
    chex.assert_shape(layer.shared_w_gate[...], (64, 64))


@pytest.mark.slow
def test_gradients_skip_the_router_bias():
    cfg = SCALED_PRESETS["tiny"]
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (16, cfg.d_model))

    def loss(model):
        y, aux = model(x)
        return jnp.sum(y.astype(jnp.float32) ** 2) + aux.loss

    grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Param))(layer)
    assert "router_bias" not in nnx.to_pure_dict(grads)

    def loss_fn(params):
        y, aux = moe(x, params, cfg)
        return jnp.sum(y.astype(jnp.float32) ** 2) + aux.loss

    expected = jax.grad(loss_fn)(layer.params)
    chex.assert_trees_all_close(grads["w_down"][...], expected.w_down, rtol=1e-6)
    chex.assert_trees_all_close(grads["router"][...], expected.router, rtol=1e-6)


def test_optimizer_step_and_bias_update():
    cfg = SCALED_PRESETS["tiny"]
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(layer, optax.adamw(1e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (32, cfg.d_model))

    @nnx.jit
    def step(model, optimizer):
        def loss(model):
            y, aux = model(x)
            return jnp.mean(y.astype(jnp.float32) ** 2) + aux.loss, aux

        (value, aux), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        optimizer.update(model, grads)
        model.update_router_bias(aux.tokens_per_expert, 1e-3)
        return value, aux

    before = nnx.clone(layer)
    # optax's Adam computes `decay**count` (float ** int32), which strict promotion rejects;
    # the promotion is optax's, mok_jax's own code runs strict in every other test.
    with jax.numpy_dtype_promotion("standard"):
        _, aux = step(layer, optimizer)
    assert not jnp.array_equal(layer.w_gate[...], before.w_gate[...])
    load = aux.tokens_per_expert.astype(jnp.float32)
    expected_bias = before.router_bias[...] + 1e-3 * jnp.sign(jnp.mean(load) - load)
    chex.assert_trees_all_close(layer.router_bias[...], expected_bias)
    assert isinstance(layer.router_bias, RouterBias)
