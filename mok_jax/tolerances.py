"""How closely two implementations of the layer must agree: the kernels' table
(pallas_kernels/tolerances.py, one bound per compute dtype), with the layer's dtype names.

`tolerance` takes what `MoEConfig.dtype` takes ('bf16', 'bfloat16', jnp.bfloat16, ...) and
raises ValueError for a dtype that is not a compute dtype.
"""

from __future__ import annotations

import jax

from mok_jax.config import canonical_dtype, compute_dtype
from pallas_kernels import tolerances
from pallas_kernels.tolerances import TOLERANCES, Tolerance, relative_error

__all__ = ["TOLERANCES", "Tolerance", "relative_error", "tolerance"]


def tolerance(dtype: jax.typing.DTypeLike, stored: jax.typing.DTypeLike = None) -> Tolerance:
    """The agreement bound for values computed in `dtype` and, if given, stored in `stored`
    (a bf16 output of an f32 computation is only as close as bf16 rounding): the looser one."""
    stored = None if stored is None else canonical_dtype(stored)
    return tolerances.tolerance(compute_dtype(dtype), stored)
