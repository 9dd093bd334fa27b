"""Mesh-axis types: arrays made to vary over the axes of their peers inside shard_map, and a
weight made to vary gets its gradient summed over those axes; outside shard_map, no-ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_kernels.mesh import like, vary, vary_alike, varying_axes

AXIS = "data"


def test_outside_shard_map_nothing_varies():
    a = jnp.ones((2, 3))
    assert varying_axes(a) == frozenset()
    assert vary(a, frozenset()) is a
    assert vary_alike(a, None) == (a, None)
    assert like(a, a) is a


def test_inside_shard_map_arrays_vary_like_their_peers():
    mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2])
    seen = {}

    def body(x, w):
        seen["x"], seen["w"] = varying_axes(x), varying_axes(w)
        x2, w2, none = vary_alike(x, w, None)
        seen["alike"] = (varying_axes(x2), varying_axes(w2), none)
        seen["like"] = varying_axes(like(jnp.zeros_like(w), x))
        return jnp.sum(x2 * w2, keepdims=True)

    def loss(w, x):
        shard = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P()), out_specs=P(AXIS))
        return jnp.sum(shard(x, w))

    x = jax.device_put(jnp.arange(4.0).reshape(4, 1), jax.NamedSharding(mesh, P(AXIS)))
    d_w = jax.jit(jax.grad(loss))(jax.device_put(jnp.ones((1,)), jax.NamedSharding(mesh, P())), x)
    assert seen["x"] == {AXIS} and seen["w"] == frozenset()
    assert seen["alike"] == (frozenset({AXIS}), frozenset({AXIS}), None)
    assert seen["like"] == {AXIS}
    # The weight met both devices' rows: its gradient is their sum, 0 + 1 + 2 + 3.
    np.testing.assert_array_equal(d_w, [6.0])
