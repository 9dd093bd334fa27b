"""MoEParams: a pytree with the shapes of its config, a fan-in initializer, a shape check."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax import MoEParams, init_params
from mok_jax.params import expected_shapes, validate_params
from tests.mok_jax.cases import SCALED_PRESETS


@pytest.mark.parametrize("name", ["tiny", "deepseek_v3"])
def test_init_shapes_dtypes_and_scale(name):
    cfg = SCALED_PRESETS[name]
    params = init_params(jax.random.key(0), cfg)
    for field, shape in expected_shapes(cfg).items():
        value = getattr(params, field)
        if shape is None:
            assert value is None
            continue
        chex.assert_shape(value, shape)
        chex.assert_type(value, jnp.float32)
    chex.assert_trees_all_equal(params.router_bias, jnp.zeros(cfg.num_experts))
    # fan-in scaling: unit-variance rows keep unit variance through each projection
    std = float(jnp.std(params.w_gate)) * np.sqrt(cfg.d_model)
    assert 0.8 < std < 1.2, std
    assert float(jnp.std(params.w_down)) * np.sqrt(cfg.d_ff) == pytest.approx(std, rel=0.2)


def test_init_is_a_function_of_the_key():
    cfg = SCALED_PRESETS["tiny"]
    chex.assert_trees_all_equal(
        init_params(jax.random.key(3), cfg), init_params(jax.random.key(3), cfg)
    )
    other = init_params(jax.random.key(4), cfg)
    assert not jnp.array_equal(other.w_up, init_params(jax.random.key(3), cfg).w_up)
    bf16 = init_params(jax.random.key(3), cfg, dtype="bfloat16")
    chex.assert_type(bf16.w_up, jnp.bfloat16)


def test_pytree_round_trip():
    params = init_params(jax.random.key(0), SCALED_PRESETS["tiny"])
    leaves, treedef = jax.tree.flatten(params)
    assert len(leaves) == 5  # the three shared fields are None: no leaves
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert isinstance(rebuilt, MoEParams)
    chex.assert_trees_all_equal(rebuilt, params)
    doubled = jax.jit(lambda p: jax.tree.map(lambda a: 2 * a, p))(params)
    chex.assert_trees_all_close(doubled.w_gate, 2 * params.w_gate)


def test_validate_lists_every_problem():
    cfg = SCALED_PRESETS["deepseek_v3"]
    params = init_params(jax.random.key(0), cfg)
    validate_params(params, cfg)
    bad = dataclasses.replace(
        params,
        w_gate=params.w_gate[:, :, :32],
        shared_w_down=None,
        router=params.router.astype(jnp.int32),
    )
    with pytest.raises(ValueError) as error:
        validate_params(bad, cfg)
    message = str(error.value)
    assert "w_gate has shape (32, 64, 32), expected (32, 64, 64)" in message
    assert "shared_w_down is None" in message
    assert "router has dtype int32" in message


def test_validate_rejects_shared_weights_without_shared_experts():
    cfg = SCALED_PRESETS["tiny"]
    params = dataclasses.replace(
        init_params(jax.random.key(0), cfg), shared_w_up=jnp.ones((64, 128))
    )
    with pytest.raises(ValueError, match="shared_w_up must be None with num_shared_experts=0"):
        validate_params(params, cfg)
    with pytest.raises(ValueError, match="params must be a MoEParams"):
        validate_params({"router": None}, cfg)
