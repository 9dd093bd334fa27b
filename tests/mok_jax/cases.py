"""Shared inputs and checks for the layer tests: bf16-rounded random data, one random
cotangent, and the comparison against the tolerance table."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np

from mok_jax import (
    MoEAux,
    MoEConfig,
    MoEOptions,
    MoEParams,
    compiler_options,
    init_params,
    moe,
    presets,
    scale_down,
)
from mok_jax.tolerances import tolerance

SCALED_PRESETS = {name: cfg if name == "tiny" else scale_down(cfg) for name, cfg in presets.items()}


def bf16_rounded(tree):
    """Rounds every float leaf through bf16, so every compute dtype sees the same values."""
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(a.dtype), tree)


def random_inputs(
    cfg: MoEConfig, num_tokens: int, seed: int = 0, *, x_dtype=None
) -> tuple[jax.Array, MoEParams, jax.Array]:
    """(x [T, D], params, cotangent [T, D] f32), x and params rounded through bf16."""
    key_p, key_x, key_c = jax.random.split(jax.random.key(seed), 3)
    params = bf16_rounded(init_params(key_p, cfg))
    x = bf16_rounded(jax.random.normal(key_x, (num_tokens, cfg.d_model), jnp.float32))
    x = x.astype(x_dtype or cfg.dtype)
    return x, params, jax.random.normal(key_c, (num_tokens, cfg.d_model), jnp.float32)


def loss_and_outputs(x, params, cotangent, cfg: MoEConfig):
    """A scalar that touches every output: <y, cotangent> + aux losses; and (y, aux)."""
    y, aux = moe(x, params, cfg)
    return jnp.vdot(y.astype(jnp.float32), cotangent) + aux.loss, (y, aux)


def jit_value_and_grads():
    """A freshly jitted ((loss, (y, aux)), (dx, dparams)) of `loss_and_outputs`, compiled
    with the deterministic options (a new jit compiles anew)."""

    def value_and_grads(x, params, cotangent, cfg: MoEConfig):
        return jax.value_and_grad(loss_and_outputs, argnums=(0, 1), has_aux=True)(
            x, params, cotangent, cfg
        )

    return jax.jit(value_and_grads, static_argnames="cfg", compiler_options=compiler_options())


value_and_grads = jit_value_and_grads()


def assert_close(actual, expected, dtype) -> None:
    """chex comparison of two pytrees under the tolerance of compute dtype `dtype` (looser for
    a leaf stored in a coarser dtype), on the host: the f32 copies of a real-size layer's
    gradients need not fit beside the arrays on the device."""
    chex.assert_trees_all_equal_structs(actual, expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        chex.assert_equal_shape([a, e])
        tol = tolerance(dtype, jnp.result_type(a))
        e = np.asarray(e, np.float32)
        chex.assert_trees_all_close(
            np.asarray(a, np.float32), e, rtol=tol.rtol, atol=tol.scaled_atol(e)
        )


def assert_aux_equal(actual: MoEAux, expected: MoEAux) -> None:
    """Counts must match exactly; the losses (always f32) to f32 tolerance."""
    chex.assert_trees_all_equal(actual.tokens_per_expert, expected.tokens_per_expert)
    chex.assert_trees_all_equal(actual.dropped, expected.dropped)
    assert_close(
        (actual.aux_loss, actual.z_loss), (expected.aux_loss, expected.z_loss), jnp.float32
    )


def assert_same_rows(result, base, dtype) -> None:
    """Two ((loss, (y, aux)), (dx, dparams)) results of one batch on different meshes: y and dx
    the same bits, the counts exactly, the parameter gradients (sums over devices) to the
    tolerance of `dtype`."""
    (_, (y, aux)), (dx, dp) = result
    (_, (y1, aux1)), (dx1, dp1) = base
    chex.assert_trees_all_equal(y, y1)
    chex.assert_trees_all_equal(dx, dx1)
    assert_aux_equal(aux, aux1)
    assert_close(dp, dp1, dtype)


def assert_close_results(result, expected, dtype) -> None:
    """Two ((loss, (y, aux)), (dx, dparams)) results to the tolerance of `dtype`, counts
    exactly."""
    (_, (y, aux)), grads = result
    (_, (y_e, aux_e)), grads_e = expected
    assert_close((y, grads), (y_e, grads_e), dtype)
    assert_aux_equal(aux, aux_e)


def with_impl(cfg: MoEConfig, implementation: str, **changes) -> MoEConfig:
    """cfg with another implementation and `changes`, fields of MoEConfig or of its options
    (`MoEOptions`: rows, residuals, token_chunk, ...). For an implementation other than
    `fused` (or "auto"), cfg's `fused` options are left behind: only token_chunk applies."""
    names = {f.name for f in dataclasses.fields(MoEOptions)}
    options = {name: changes.pop(name) for name in list(changes) if name in names}
    base = cfg.options
    if implementation not in ("fused", "auto"):
        base = MoEOptions(token_chunk=base.token_chunk)
    changes["options"] = dataclasses.replace(base, **options)
    return dataclasses.replace(cfg, implementation=implementation, **changes)


def num_gpus() -> int:
    """How many CUDA GPUs jax sees (0 on a CPU machine)."""
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0
