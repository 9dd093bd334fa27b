"""Rows between the devices of the `expert` mesh axis: deterministic, dropless, bounded memory.

Inside `jax.shard_map`, each device holds its tokens' N routed rows sorted by expert. Experts
are split evenly over the EP devices of the `expert` axis (device d owns experts
[d*G, (d+1)*G)), so the sorted rows are also sorted by destination. Every device learns every
device's per-expert counts (an all_gather of E ints); from them (`Traffic`, from
pallas_kernels/exchange/protocol.py, which the in-kernel exchange's tables start from too),
prefix sums give each row's destination slot before anything moves:

  a receiver concatenates what it gets in source order, each source's rows in their sorted
  order: (source device, position), never arrival order. Rows of one expert therefore arrive
  in global token order (tokens are sharded over devices in order).

Bounded memory: a receiver holds a window of `window` rows (a multiple of the balanced load).
Round r carries the rows at positions [r*window, (r+1)*window) of each receiver's concatenated
order; the devices agree on the round count (a pmax) and loop. The ring exchange cuts each
(source, destination) block into chunks of `chunk` rows instead, one hop per peer per round.

Invariants (tested):
  1. Transfers are copies: every row arrives bitwise, at the slot the counts say.
  2. Each (source, destination) chunk is contiguous on both sides, and chunks are in peer order
     on both sides.
  3. A transfer's gradient is the reverse transfer (no scatter-add).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array, lax

from pallas_kernels.exchange.protocol import Traffic


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "send_offsets",
        "send_sizes",
        "remote_offsets",
        "recv_sizes",
        "recv_offsets",
        "source_offsets",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Transfer:
    """One device's view of one exchange, per peer p ([EP] int32 each), in the terms of
    `lax.ragged_all_to_all`: it sends operand[send_offsets[p] : + send_sizes[p]] to p, where
    it lands at p's output[remote_offsets[p]:]; it receives recv_sizes[p] rows from p at its
    output[recv_offsets[p]:], which came from p's operand[source_offsets[p]:]."""

    send_offsets: Array
    send_sizes: Array
    remote_offsets: Array
    recv_sizes: Array
    recv_offsets: Array
    source_offsets: Array

    def reversed(self) -> Transfer:
        """The transfer that sends every received row back where it came from."""
        return Transfer(
            send_offsets=self.recv_offsets,
            send_sizes=self.recv_sizes,
            remote_offsets=self.source_offsets,
            recv_sizes=self.send_sizes,
            recv_offsets=self.send_offsets,
            source_offsets=self.remote_offsets,
        )


def window_transfer(t: Traffic, me: Array, round_index: Array, window: int) -> Transfer:
    """Round `round_index` of the windowed exchange, seen from device `me`."""
    lo_w, hi_w = round_index * window, (round_index + 1) * window
    start_sd = t.recv_off_sd
    lo_sd = jnp.clip(start_sd, lo_w, hi_w)
    hi_sd = jnp.clip(start_sd + t.send_sd, lo_w, hi_w)
    size_sd = hi_sd - lo_sd
    # Rows of the block sent in earlier rounds; clipped to the block so that empty chunks keep
    # their offsets in peer order too (invariant 2).
    skip_sd = jnp.clip(lo_sd - start_sd, 0, t.send_sd)
    return Transfer(
        send_offsets=t.send_start_sd[me] + skip_sd[me],
        send_sizes=size_sd[me],
        remote_offsets=lo_sd[me] - lo_w,
        recv_sizes=size_sd[:, me],
        recv_offsets=lo_sd[:, me] - lo_w,
        source_offsets=t.send_start_sd[:, me] + skip_sd[:, me],
    )


def window_experts(t: Traffic, me: Array, round_index: Array, window: int) -> Array:
    """int32 [window]: the local expert of each row of my window in this round (G: empty)."""
    g = t.num_local
    mine_sg = lax.dynamic_slice_in_dim(t.counts_se, me * g, g, axis=1)
    ends_sg = t.recv_off_sd[:, me, None] + jnp.cumsum(mine_sg, axis=1, dtype=jnp.int32)
    position_w = round_index * window + jnp.arange(window, dtype=jnp.int32)
    flat_w = jnp.searchsorted(
        ends_sg.reshape(-1), position_w, side="right", method="scan_unrolled"
    ).astype(jnp.int32)
    return jnp.where(position_w < t.recv_total_d[me], flat_w % g, g)


def row_window_round(t: Traffic, me: Array, dest_n: Array, window: int) -> Array:
    """int32 [N]: the round in which each of my sorted rows travels."""
    rank_n = jnp.arange(dest_n.shape[0], dtype=jnp.int32) - t.send_start_sd[me, dest_n]
    return (t.recv_off_sd[me, dest_n] + rank_n) // window


def chunk_rounds(t: Traffic, chunk: int) -> Array:
    """int32 []: rounds the ring exchange needs (>= 1): chunks of the largest block."""
    return jnp.maximum(jnp.max((t.send_sd + chunk - 1) // chunk), 1)


def chunk_rows(t: Traffic, source: Array, dest: Array, round_index: Array, chunk: int):
    """(index_c, experts_c): the rows of source's block for dest in this round's chunk, as
    row indices in the source's sorted rows (-1 past the block) and as local experts of dest
    (G past the block)."""
    g = t.num_local
    rank_c = round_index * chunk + jnp.arange(chunk, dtype=jnp.int32)
    valid_c = rank_c < t.send_sd[source, dest]
    index_c = jnp.where(valid_c, t.send_start_sd[source, dest] + rank_c, -1)
    counts_g = lax.dynamic_slice_in_dim(t.counts_se[source], dest * g, g)
    experts_c = jnp.searchsorted(
        jnp.cumsum(counts_g, dtype=jnp.int32), rank_c, side="right", method="scan_unrolled"
    )
    return index_c, jnp.where(valid_c, experts_c.astype(jnp.int32), g)


# --- the transfer itself --------------------------------------------------------------------


def _ragged(operand_ad: Array, tr: Transfer, out_rows: int, axis: str) -> Array:
    # zeros_like: the buffer varies over the same mesh axes as the rows written into it.
    output = jnp.zeros_like(operand_ad, shape=(out_rows, *operand_ad.shape[1:]))
    return lax.ragged_all_to_all(
        operand_ad,
        output,
        tr.send_offsets,
        tr.send_sizes,
        tr.remote_offsets,
        tr.recv_sizes,
        axis_name=axis,
    )


def _dense(operand_ad: Array, tr: Transfer, out_rows: int, axis: str) -> Array:
    """`_ragged`'s result from a dense all_to_all of [EP, L] padded chunks (XLA:CPU has no
    ragged_all_to_all). Gathers only: chunk p is read from operand rows send_offsets[p] + l."""
    num_rows = operand_ad.shape[0]
    width = min(num_rows, out_rows)
    lane_l = jnp.arange(width, dtype=jnp.int32)
    index_pl = tr.send_offsets[:, None] + lane_l
    valid_pl = lane_l < tr.send_sizes[:, None]
    send_pld = jnp.where(
        valid_pl[..., None], operand_ad[jnp.clip(index_pl, 0, num_rows - 1)], 0
    ).astype(operand_ad.dtype)
    recv_pld = lax.all_to_all(send_pld, axis, 0, 0, tiled=False)
    # Chunks sit in peer order in the output (invariant 2): find each output row's peer.
    ends_p = tr.recv_offsets + tr.recv_sizes
    row_o = jnp.arange(out_rows, dtype=jnp.int32)
    peer_o = jnp.searchsorted(ends_p, row_o, side="right", method="scan_unrolled").astype(jnp.int32)
    peer_c = jnp.minimum(peer_o, ends_p.shape[0] - 1)
    lane_o = row_o - tr.recv_offsets[peer_c]
    valid_o = (peer_o < ends_p.shape[0]) & (lane_o >= 0) & (lane_o < tr.recv_sizes[peer_c])
    rows_od = recv_pld[peer_c, jnp.clip(lane_o, 0, width - 1)]
    return jnp.where(valid_o[:, None], rows_od, 0).astype(operand_ad.dtype)


def _transfer(operand_ad: Array, tr: Transfer, out_rows: int, axis: str) -> Array:
    return lax.platform_dependent(
        operand_ad,
        tr,
        cpu=lambda o, t: _dense(o, t, out_rows, axis),
        default=lambda o, t: _ragged(o, t, out_rows, axis),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def transfer(operand_ad: Array, tr: Transfer, out_rows: int, axis: str) -> Array:
    """Moves rows as `tr` says: operand [A, D] -> [out_rows, D] (zeros where nothing lands).
    `lax.ragged_all_to_all` on GPU; a dense all_to_all on CPU. Call inside shard_map."""
    return _transfer(operand_ad, tr, out_rows, axis)


def _transfer_fwd(operand_ad, tr, out_rows, axis):
    return _transfer(operand_ad, tr, out_rows, axis), (tr, operand_ad.shape[0])


def _transfer_bwd(out_rows, axis, residuals, g_od):
    tr, num_rows = residuals
    return _transfer(g_od, tr.reversed(), num_rows, axis), None


transfer.defvjp(_transfer_fwd, _transfer_bwd)
