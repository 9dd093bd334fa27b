"""The exchange's dispatch in plain JAX (the spec of mosaic_gpu.dispatch): inside
`jax.shard_map`, every device's rows of one round land in their receivers' buffers, at the
slots the protocol gives them."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array, lax


def dispatch(
    x_nd: Array,
    dest_n: Array,
    round_n: Array,
    slot_n: Array,
    round_index: Array,
    *,
    num_slots: int,
    axis_name: str,
) -> Array:
    """This device's receive buffer [S, D] of round `round_index`: slot q holds the row some
    device sent to slot q of this device in that round, zeros elsewhere.

    x_nd [N, D] are this device's rows; dest_n, round_n, slot_n (int32 [N]) each row's
    receiver (its index along `axis_name`), round and slot (-1: the row goes nowhere), as
    `mok_jax.exchange_protocol.row_places` gives them.
    """
    me = lax.axis_index(axis_name)
    x_snd, dest_sn, round_sn, slot_sn = (
        lax.all_gather(a, axis_name) for a in (x_nd, dest_n, round_n, slot_n)
    )
    mine_sn = (dest_sn == me) & (round_sn == round_index) & (slot_sn >= 0)
    # Distinct slots (the protocol's invariant 1): a set, not an accumulation; rows of
    # other devices and rounds go past the end and are dropped.
    index = jnp.where(mine_sn, slot_sn, num_slots).reshape(-1)
    rows = x_snd.reshape(-1, x_nd.shape[-1])
    return jnp.zeros((num_slots, x_nd.shape[-1]), x_nd.dtype).at[index].set(rows, mode="drop")
