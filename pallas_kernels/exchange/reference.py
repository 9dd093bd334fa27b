"""One direction of the exchange in plain JAX (the spec of mosaic_gpu.send_rows, and its
stand-in where Mosaic GPU cannot run): inside `jax.shard_map`, the rows every device's `Moves`
copy in one round land in their peers' outputs, and each device's zero ranges are zeros."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array, lax

from pallas_kernels.exchange.moves import Moves


def send_rows(
    src_ad: Array,
    moves: Moves,
    round_index: Array,
    *,
    out_rows: int,
    axis_name: str,
    unfilled: float = 0.0,
) -> Array:
    """This device's output [out_rows, D] of round `round_index`: `mosaic_gpu.send_rows`'s
    contract, with all_gathers. Output row o comes from the one copy of the round whose
    destination rows [dst, dst + size) on this device hold o; rows in this device's zero ranges
    are zeros; the other rows, which the kernel leaves unspecified, are `unfilled` (a test can
    make them NaN to show that nothing reads them)."""
    moves.check()
    me = lax.axis_index(axis_name)
    gather = lambda a: lax.all_gather(a, axis_name)  # noqa: E731
    src_sad = gather(src_ad)
    _, num_rows, d_model = src_sad.shape
    src_sp, dst_sp, size_sp, peer_sp, round_sp = (
        gather(a) for a in (moves.src_p, moves.dst_p, moves.size_p, moves.peer_p, moves.round_p)
    )
    real_sp = jnp.arange(src_sp.shape[1]) < gather(moves.count)[:, None]
    mine_sp = real_sp & (peer_sp == me) & (round_sp == round_index) & (size_sp > 0)
    # This device's copies sorted by their first destination row (the protocol keeps them
    # disjoint); the others after them.
    key = jnp.where(mine_sp, dst_sp, out_rows).reshape(-1)
    order = jnp.argsort(key, stable=True)
    dst_c, key_c = dst_sp.reshape(-1)[order], key[order]
    row_o = jnp.arange(out_rows, dtype=jnp.int32)
    c_o = jnp.searchsorted(key_c, row_o, side="right") - 1  # the last copy starting at or before o
    c_o = jnp.clip(c_o, 0, key_c.shape[0] - 1)
    flat = order[c_o]
    lane_o = row_o - dst_c[c_o]
    hit_o = (key_c[c_o] <= row_o) & (lane_o < size_sp.reshape(-1)[flat])
    source_o = flat // src_sp.shape[1]
    index_o = jnp.clip(src_sp.reshape(-1)[flat] + lane_o, 0, num_rows - 1)
    rows_od = src_sad.reshape(-1, d_model)[source_o * num_rows + index_o]
    zero_o = jnp.any(
        (row_o[:, None] >= moves.zero_dst_z)
        & (row_o[:, None] < moves.zero_dst_z + moves.zero_size_z),
        axis=1,
    )
    rest_od = jnp.where(zero_o[:, None], 0, unfilled).astype(src_ad.dtype)
    return jnp.where(hit_o[:, None], rows_od, rest_od)
