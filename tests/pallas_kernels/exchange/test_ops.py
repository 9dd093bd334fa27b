"""The exchange's differentiable ops. ops.send_rows: its gradient is the reverse direction's
copy, which must be the transpose of the forward copy (checked against `jax.linear_transpose`
of the reference, on 8 CPU devices, for the dispatch and for the return, round by round).
ops.dispatch_mlp_grads: the backward from the cotangent prepared once for all rounds is
dispatch_mlp's VJP, bit for bit."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mok_jax import exchange
from mok_jax import exchange_protocol as xp
from pallas_kernels.exchange import ops, reference
from tests.mok_jax.test_pallas_mesh import gpu_interpret_on_several_devices
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
        t = exchange.traffic(counts_se, num_local)
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
    t = exchange.traffic(jnp.asarray(counts_se), num_local)
    rounds = int(exchange.window_rounds(t, window))
    assert rounds >= 2
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, P(AXIS)))  # noqa: E731
    for r in range(rounds):
        _, counts, round_index = placed(mesh, x, counts_se, r)
        d_x, t_x, d_y, t_y = fn(put(x), put(g), counts, round_index)
        chex.assert_trees_all_equal(d_x, t_x)
        chex.assert_trees_all_equal(d_y, t_y)
        # Not vacuous: the round moves rows both ways.
        assert np.count_nonzero(np.asarray(d_x)) and np.count_nonzero(np.asarray(d_y))


@pytest.mark.parametrize("grad_copy_programs", [24, 0])
def test_the_backward_from_the_prepared_cotangent_is_the_vjp(grad_copy_programs):
    """dispatch_mlp_grads(dispatch_mlp_cotangent(g), ...) is dispatch_mlp's VJP of g, bit for
    bit, values and every gradient (4 CPU devices, the GEMMs in interpret mode, two rounds):
    from the cotangent rounded and weighted (the kernels' forms, grad_copy_programs 24) and
    as f32 (0)."""
    num_devices, num_local, num_rows, window, tile, d_model, d_ff = 4, 2, 16, 8, 4, 64, 64
    counts_se = random_counts(3, num_devices, num_local, num_rows)
    slots = xp.num_tiles(window, tile, num_local) * tile
    keys = jax.random.split(jax.random.key(1), 6)
    rows, experts = num_devices * num_rows, num_devices * num_local
    x = jax.random.normal(keys[0], (rows, d_model)).astype(jnp.bfloat16)
    scale = jax.random.uniform(keys[1], (rows,), jnp.float32, 0.1, 1.0)
    g = jax.random.normal(keys[2], (rows, d_model), jnp.float32)
    shapes = ((experts, d_model, d_ff), (experts, d_model, d_ff), (experts, d_ff, d_model))
    weights = [
        (0.1 * jax.random.normal(k, shape)).astype(jnp.bfloat16)
        for k, shape in zip(keys[3:], shapes, strict=True)
    ]
    options = dict(out_rows=slots, tile=tile, axis_name=AXIS,
                   grad_copy_programs=grad_copy_programs, interpret=True)  # fmt: skip
    mesh = jax.make_mesh((num_devices,), (AXIS,))

    def body(x, scale, g, w_gate, w_up, w_down, counts_se, round_index):
        t = exchange.traffic(counts_se, num_local)
        me = jax.lax.axis_index(AXIS)
        dispatch, back = xp.exchange_moves(t, me, round_index, num_rows, window, tile)
        group_sizes, _ = xp.buffer_layout(t, me, round_index, window, tile)

        def forward(x, scale, *weights):
            return ops.dispatch_mlp(x, scale, dispatch, back, round_index, *weights,
                                    group_sizes, **options)  # fmt: skip

        _, vjp = jax.vjp(forward, x, scale, w_gate, w_up, w_down)
        cotangent = ops.dispatch_mlp_cotangent(g, scale, x.dtype, **options)
        assert len(cotangent) == (2 if grad_copy_programs else 1)
        direct = ops.dispatch_mlp_grads(cotangent, x, scale, dispatch, back, round_index,
                                        w_gate, w_up, w_down, group_sizes, **options)  # fmt: skip
        return vjp(g), direct

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 6 + (P(), P()),
                      out_specs=((P(AXIS),) * 5,) * 2)
    )  # fmt: skip
    t = exchange.traffic(jnp.asarray(counts_se), num_local)
    assert int(exchange.window_rounds(t, window)) >= 2
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, P(AXIS)))  # noqa: E731
    with gpu_interpret_on_several_devices():
        for r in range(2):
            _, counts, round_index = placed(mesh, x, counts_se, r)
            by_vjp, direct = fn(put(x), put(scale), put(g), *map(put, weights), counts,
                                round_index)  # fmt: skip
            chex.assert_trees_all_equal(direct, by_vjp)
            # Not vacuous: every gradient has nonzeros.
            assert all(np.count_nonzero(np.asarray(a)) for a in direct)
