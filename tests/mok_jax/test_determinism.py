"""The compile options: XLA knows every name (a misspelt one fails the compile), and the
layer's forward+backward compiles and runs with them."""

import chex
import jax
import jax.numpy as jnp
import pytest

import mok_jax
from tests.mok_jax.cases import SCALED_PRESETS, random_inputs


def test_options_contain_the_determinism_subset():
    options = mok_jax.compiler_options()
    assert mok_jax.deterministic_compiler_options().items() <= options.items()
    assert options["xla_gpu_unsupported_enable_ragged_all_to_all_decomposer"] is True


def test_options_ask_for_untimed_gemms_and_deterministic_ops():
    options = mok_jax.deterministic_compiler_options()
    assert options["xla_gpu_autotune_level"] == 0
    assert options["xla_gpu_enable_triton_gemm"] is False
    assert options["xla_gpu_deterministic_ops"] is True


def test_xla_accepts_every_option():
    for options in (mok_jax.compiler_options(), mok_jax.deterministic_compiler_options()):
        double = jax.jit(lambda a: 2 * a, compiler_options=options)
        chex.assert_trees_all_equal(double(jnp.arange(3.0)), jnp.array([0.0, 2.0, 4.0]))


def test_a_misspelt_option_would_fail():
    # What the test above relies on: XLA refuses names it does not know.
    bad = jax.jit(lambda a: 2 * a, compiler_options={"xla_gpu_no_such_option": True})
    with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option"):
        bad(jnp.arange(3.0))


def test_layer_under_the_options_equals_plain_jit():
    cfg = SCALED_PRESETS["qwen3_30b_a3b"]
    x, params, _ = random_inputs(cfg, 32)
    plain = jax.jit(mok_jax.moe, static_argnames="cfg")(x, params, cfg=cfg)
    tuned = jax.jit(mok_jax.moe, static_argnames="cfg", compiler_options=mok_jax.compiler_options())
    chex.assert_trees_all_equal(tuned(x, params, cfg=cfg), plain)
