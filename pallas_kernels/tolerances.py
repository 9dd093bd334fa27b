"""How closely two implementations must agree: one table, keyed by compute dtype.

Implementations round the same inputs the same way and differ only in the order of f32
accumulations and in rare one-ulp flips when an f32 intermediate (the SwiGLU output h, a bf16
cotangent) is rounded to the compute dtype. The bounds are a few units in the last place of the
compute dtype: `atol` is relative to the largest magnitude of the expected tensor, `rtol` to
each element. The kernels' tests and the layer's (mok_jax/tolerances.py) use this one table.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tolerance:
    rtol: float
    atol: float  # times max |expected| of the tensor compared

    def scaled_atol(self, expected: jax.Array) -> float:
        scale = float(np.max(np.abs(np.asarray(expected, np.float32)), initial=0.0))
        return self.atol * max(scale, 1e-30)


# Eight units of roundoff of the compute dtype (u = 2^-9 for bf16, 2^-12 for f16) cover a
# rounding flip of h or of a summed cotangent plus accumulation-order differences; f32 results
# are sums of thousands of terms at most in tests, 1e-5 (about 170 u) bounds their reordering.
TOLERANCES: dict[np.dtype, Tolerance] = {
    jnp.dtype("float32"): Tolerance(rtol=1e-5, atol=1e-5),
    jnp.dtype("bfloat16"): Tolerance(rtol=2**-6, atol=2**-6),
    jnp.dtype("float16"): Tolerance(rtol=2**-9, atol=2**-9),
}


def tolerance(dtype: jax.typing.DTypeLike, stored: jax.typing.DTypeLike = None) -> Tolerance:
    """The agreement bound for values computed in `dtype` and, if given, stored in `stored`
    (a bf16 output of an f32 computation is only as close as bf16 rounding): the looser one.
    Raises ValueError for a `dtype` the table does not hold."""
    compute = jnp.dtype(dtype)
    if compute not in TOLERANCES:
        names = tuple(dt.name for dt in TOLERANCES)
        raise ValueError(f"dtype={compute.name} is not a compute dtype; use one of {names}")
    bound = TOLERANCES[compute]
    if stored is not None and jnp.dtype(stored) in TOLERANCES:
        bound = max(bound, TOLERANCES[jnp.dtype(stored)], key=lambda t: t.atol)
    return bound


def relative_error(actual: jax.Array, expected: jax.Array) -> float:
    """max |actual - expected| / max |expected| (0 when both are all zeros)."""
    actual = jnp.asarray(actual, jnp.float32)
    expected = jnp.asarray(expected, jnp.float32)
    diff = float(jnp.max(jnp.abs(actual - expected), initial=0.0))
    scale = float(jnp.max(jnp.abs(expected), initial=0.0))
    return diff / scale if scale else diff
