"""The layer's tolerances: the kernels' one table (pallas_kernels/tolerances.py), with the
layer's dtype names."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from mok_jax.tolerances import TOLERANCES, relative_error, tolerance
from pallas_kernels import tolerances


def test_bounds_follow_precision():
    f32, bf16, f16 = (tolerance(d) for d in ("float32", "bfloat16", "float16"))
    assert f32.atol < f16.atol < bf16.atol
    assert tolerance("float32", jnp.bfloat16) == bf16  # a bf16 output of f32 work
    assert tolerance("bfloat16", jnp.float32) == bf16  # f32 storage does not make bf16 exact
    assert len(TOLERANCES) == 3
    assert TOLERANCES is tolerances.TOLERANCES  # one table, in one place
    assert tolerance("bf16") is tolerances.tolerance(jnp.bfloat16)


def test_unknown_compute_dtype():
    with pytest.raises(ValueError, match="not a compute dtype"):
        tolerance("float64")


def test_relative_error():
    assert relative_error(jnp.array([1.0, 2.1]), jnp.array([1.0, 2.0])) == pytest.approx(0.05)
    assert relative_error(jnp.zeros(2), jnp.zeros(2)) == 0.0
