"""Mesh-axis types inside `jax.shard_map`: which axes an array varies over, and making it vary.

Inside shard_map a Pallas kernel's output is typed as invariant over the mesh axes whatever its
inputs, and a custom VJP's cotangents must have their primal's type; weights that meet varying
tokens must vary too, so that their gradient comes back summed over those axes. Outside
shard_map every array varies over no axis and each function here returns its input.
"""

from __future__ import annotations

import jax
from jax import Array, lax


def varying_axes(a: Array) -> frozenset[str]:
    """The mesh axes `a` varies over inside shard_map (none outside)."""
    return frozenset(jax.typeof(a).manual_axis_type.varying)


def vary(a: Array, axes: frozenset[str]) -> Array:
    """`a`, made to vary over `axes` too (its gradient is then summed over them)."""
    missing = tuple(sorted(axes - varying_axes(a)))
    return lax.pcast(a, missing, to="varying") if missing else a


def vary_alike(*arrays: Array | None) -> tuple[Array | None, ...]:
    """The arrays, each made to vary over every mesh axis one of them varies over."""
    axes = frozenset().union(*(varying_axes(a) for a in arrays if a is not None))
    return tuple(None if a is None else vary(a, axes) for a in arrays)


def like(out: Array, operand: Array) -> Array:
    """A kernel's output, typed to vary over the mesh axes `operand` varies over (the kernel's
    output type drops them)."""
    return vary(out, varying_axes(operand))
