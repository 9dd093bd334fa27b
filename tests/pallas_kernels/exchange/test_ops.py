"""ops.send_rows, the exchange's differentiable op: its gradient is the reverse direction's
copy, which must be the transpose of the forward copy (checked against `jax.linear_transpose`
of the reference, on 8 CPU devices, for the dispatch and for the return, round by round)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_kernels.exchange import ops, reference
from pallas_kernels.exchange import protocol as xp
from tests.pallas_kernels.exchange.test_mosaic_gpu import AXIS, placed, random_counts


def test_the_gradient_is_the_transpose_of_the_copy():
    num_devices, num_local, num_rows, window, tile, d_model = 8, 2, 24, 24, 4, 16
    counts_se = random_counts(2, num_devices, num_local, num_rows)
    slots = xp.num_tiles(window, tile, num_local) * tile
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (num_devices * num_rows, d_model), jnp.float32)
    g = jax.random.normal(keys[1], (num_devices * slots, d_model), jnp.float32)
    mesh = jax.make_mesh((num_devices,), (AXIS,))

    def body(x, g, counts_se, round_index):
        t = xp.traffic(counts_se, num_local)
        me = jax.lax.axis_index(AXIS)
        dispatch, back = xp.exchange_moves(t, me, round_index, num_rows, window, tile)

        def there(a):
            return ops.send_rows(a, dispatch, back, round_index, slots, AXIS, "reference")

        def back_again(a):
            return ops.send_rows(a, back, dispatch, round_index, num_rows, AXIS, "reference")

        def spec(a, moves, rows):
            return reference.send_rows(a, moves, round_index, out_rows=rows, axis_name=AXIS)

        # The dispatch's gradient, and the return's, against the transposed spec.
        _, vjp = jax.vjp(there, x)
        (t_x,) = jax.linear_transpose(lambda a: spec(a, dispatch, slots), x)(g)
        y = there(x)
        _, vjp_back = jax.vjp(back_again, y)
        (t_y,) = jax.linear_transpose(lambda a: spec(a, back, num_rows), y)(x)
        return vjp(g)[0], t_x, vjp_back(x)[0], t_y

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(), P()),
                      out_specs=(P(AXIS),) * 4)
    )  # fmt: skip
    t = xp.traffic(jnp.asarray(counts_se), num_local)
    rounds = int(xp.window_rounds(t, window))
    assert rounds >= 2
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, P(AXIS)))  # noqa: E731
    for r in range(rounds):
        _, counts, round_index = placed(mesh, x, counts_se, r)
        d_x, t_x, d_y, t_y = fn(put(x), put(g), counts, round_index)
        chex.assert_trees_all_equal(d_x, t_x)
        chex.assert_trees_all_equal(d_y, t_y)
        # Not vacuous: the round moves rows both ways.
        assert np.count_nonzero(np.asarray(d_x)) and np.count_nonzero(np.asarray(d_y))
