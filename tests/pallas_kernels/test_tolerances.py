"""The tolerance table: one bound per compute dtype, loosened for coarser storage."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_kernels.tolerances import TOLERANCES, relative_error, tolerance


def test_bounds_follow_precision():
    f32, bf16, f16 = (tolerance(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
    assert f32.atol < f16.atol < bf16.atol
    assert tolerance(jnp.float32, jnp.bfloat16) == bf16  # a bf16 output of f32 work
    assert tolerance(jnp.bfloat16, jnp.float32) == bf16  # f32 storage does not make bf16 exact
    assert tolerance(jnp.float32, jnp.int32) == f32  # integer storage: no rounding bound
    assert len(TOLERANCES) == 3


def test_unknown_compute_dtype():
    with pytest.raises(ValueError, match="not a compute dtype"):
        tolerance(jnp.float64)


def test_relative_error():
    assert relative_error(jnp.array([1.0, 2.1]), jnp.array([1.0, 2.0])) == pytest.approx(0.05)
    assert relative_error(jnp.zeros(2), jnp.zeros(2)) == 0.0
