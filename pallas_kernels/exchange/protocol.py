"""The protocol of the in-kernel exchange: who writes which slot, which semaphore counts what,
in which order. Pure functions of the all-gathered counts (`Traffic`), so every slot and every
count is known before any row moves; the kernels (mosaic_gpu.py, ops.py) take its tables
(`Moves`) as they are.

Traffic. Experts are split evenly over the EP devices of the exchange's mesh axis (device d owns
experts [d G, (d + 1) G)); every device knows every device's per-expert counts [EP, E] (an
all_gather), from which `traffic` forms who sends how many rows to whom.

Layout. Receiver d orders the rows it gets by (its local expert g, source s, the row's position
among s's sorted rows): its expert-major order. Round r carries positions [r W, (r + 1) W) of
that order (W = `window`, the rows a receiver holds per round). In round r's buffer of U * tile
slots (U = ceil(W / tile) + G: each expert's run of a round may end in a partial tile), expert
g's rows of the round start on a tile boundary, in expert-major order: every tile holds one
expert's rows, in global token order. (Where a round boundary splits an expert's rows, its
tiles are cut there, unlike on one device; a row's own result does not depend on its tile.)

A piece is a maximal run of one source's rows in one tile of one round: one copy, one signal.

The exchange, per round r (the forward moves x and brings back the results; the backward moves
dy and brings back the input gradients the same way):
  1. Source s waits for receiver d's credit for round r - 1 (when r > 0), then copies each of
     its pieces for d to the slots `row_places` gives and signals d's semaphore of that tile
     once a piece, after the copy.
  2. Receiver d computes tile u once its semaphore has counted `tile_arrivals` pieces.
  3. It copies each piece's results back to the piece's source, to the rows' own positions, and
     signals the source's semaphore of receiver d once a piece.
  4. Once every tile of round r is computed, d gives each source a credit: round r + 1 may
     overwrite the receive buffer. Before d's round r + 1 writes its results, d waits for its
     round-r return copies to have left (its results buffer is reused too).
  5. Source s has all of round r's results back after `return_arrivals[d]` signals from each d.

Invariants (tested; 2 and 3 also on the CPU model of the copies and semaphores,
tests/pallas_kernels/exchange/protocol_sim.py, where a receiver waits for each piece's bytes on
the tile's DMA semaphore rather than counting signals):
  1. Within a receiver's round every row has its own slot; a tile holds one expert's rows.
  2. A slot is written once a round, before the wait that covers its tile returns.
  3. Every wait counts exactly the signals sent to it: no deadlock, no early read.
  4. Slots and counts are functions of the counts alone, never of arrival order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array

from pallas_kernels.exchange.moves import Moves

# The slots past a round's groups that must hold finite values: the first TAIL_ZERO_ROWS of
# them, zeroed by the dispatch; the others are left unspecified. The weight gradients' kernel
# (mosaic_gpu_wgrad) reads a group's rows in blocks of block_k rows (64 on the H200 and in
# interpret mode), so its last block may take up to block_k - 1 slots past the groups; it zeroes
# them in the rhs tile with a select and assumes the lhs finite there (its invariant 3), and
# the lhs of d_w_gate and d_w_up is the dispatched rows. No other kernel needs values past
# the groups: the grouped GEMMs compute the rows they load there and never store them
# (invariant 4 of grouped_matmul/mosaic_gpu.py), and the return copies only the rows' own
# slots. XLA's elementwise steps between the kernels make NaN of them (dh = g * scale, with
# the dispatched weights unspecified there), which stays in rows no kernel stores and which
# the weight gradients select away: a mask by multiplication there would let it through. Past the
# groups lies up to 1 - 1/buffer_factor of the buffer (half of it at EP > 1 by default),
# ~170 MB an array at qwen3 with 4096 tokens a device, which the dispatch no longer writes.
TAIL_ZERO_ROWS = 128
# The zeroed slots past the groups as this many ranges, so that the kernels' copiers zero them
# in parallel (one range a copier).
TAIL_RANGES = 8


def exclusive_cumsum(a: Array, axis: int = -1) -> Array:
    return jnp.cumsum(a, axis=axis, dtype=jnp.int32) - a.astype(jnp.int32)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["counts_se", "send_sd", "send_start_sd", "recv_off_sd"],
    meta_fields=["num_local"],
)
@dataclasses.dataclass(frozen=True)
class Traffic:
    """Who sends what to whom, the same on every device of the expert axis (int32).

    Attributes:
      counts_se: [EP, E] rows of each source device for each expert.
      send_sd: [EP, EP] rows source s sends to destination d.
      send_start_sd: [EP, EP] where s's block for d starts among s's sorted rows.
      recv_off_sd: [EP, EP] where s's block starts in d's concatenated order.
      num_local: G, experts per device.
    """

    counts_se: Array
    send_sd: Array
    send_start_sd: Array
    recv_off_sd: Array
    num_local: int

    @property
    def recv_total_d(self) -> Array:
        return jnp.sum(self.send_sd, axis=0, dtype=jnp.int32)


def traffic(counts_se: Array, num_local: int) -> Traffic:
    """`Traffic` from the all-gathered per-expert counts [EP, E]."""
    num_devices = counts_se.shape[0]
    send_sd = counts_se.reshape(num_devices, num_devices, num_local).sum(-1, dtype=jnp.int32)
    return Traffic(
        counts_se=counts_se.astype(jnp.int32),
        send_sd=send_sd,
        send_start_sd=exclusive_cumsum(send_sd, axis=1),
        recv_off_sd=exclusive_cumsum(send_sd, axis=0),
        num_local=num_local,
    )


def window_rounds(t: Traffic, window: int) -> Array:
    """int32 []: rounds the windowed exchange needs (>= 1) on this expert axis: round r carries
    positions [r W, (r + 1) W) of each receiver's order (W = `window`)."""
    return jnp.maximum(jnp.max((t.recv_total_d + window - 1) // window), 1)


def num_tiles(window: int, tile: int, num_local: int) -> int:
    """U, the tiles of a receiver's buffer: ceil(W / tile) + G (each expert's run of a round
    may end in a partial tile)."""
    _check_sizes(window, tile)
    return -(-window // tile) + num_local


def _check_sizes(window: int, tile: int) -> None:
    if window < 1 or tile < 1:
        raise ValueError(f"window={window} and tile={tile} must be >= 1")


def _counts_sdg(t: Traffic) -> Array:
    num_devices = t.counts_se.shape[0]
    return t.counts_se.reshape(num_devices, num_devices, t.num_local)


def order_starts(t: Traffic) -> tuple[Array, Array]:
    """(start_sdg, expert_start_dg): where source s's rows of d's local expert g start in d's
    expert-major order [EP, EP, G], and where expert g's rows start there [EP, G]."""
    counts_sdg = _counts_sdg(t)
    total_dg = jnp.sum(counts_sdg, axis=0, dtype=jnp.int32)
    expert_start_dg = exclusive_cumsum(total_dg, axis=1)
    return expert_start_dg[None] + exclusive_cumsum(counts_sdg, axis=0), expert_start_dg


def _round_runs(t: Traffic, dest: Array, round_index: Array, window: int, tile: int):
    """Expert g's run of round r at receiver d: (lo_g, hi_g) in expert-major positions and the
    run's first tile. dest and round_index broadcast: [...] -> [..., G] each."""
    total_dg = jnp.sum(_counts_sdg(t), axis=0, dtype=jnp.int32)
    start_g = exclusive_cumsum(total_dg, axis=1)[dest]  # order_starts' expert starts
    lo_w = (jnp.asarray(round_index, jnp.int32) * window)[..., None]
    lo_g = jnp.clip(start_g, lo_w, lo_w + window)
    hi_g = jnp.clip(start_g + total_dg[dest], lo_w, lo_w + window)
    tiles_g = (hi_g - lo_g + tile - 1) // tile
    return lo_g, hi_g, exclusive_cumsum(tiles_g, axis=-1)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["dest_n", "expert_n", "round_n", "slot_n"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class RowPlaces:
    """Where each of a source's N sorted rows goes (int32 [N] each; -1 for rows past the
    counts, which go nowhere).

    Attributes:
      dest_n: the receiver (the device owning the row's expert).
      expert_n: the row's local expert there.
      round_n: the round in which it travels.
      slot_n: its slot in the receiver's buffer in that round (tile = slot // tile).
    """

    dest_n: Array
    expert_n: Array
    round_n: Array
    slot_n: Array


def row_places(t: Traffic, source: Array, num_rows: int, window: int, tile: int) -> RowPlaces:
    """The places of source's N sorted rows (sorted by global expert, as `plan` sorts them;
    N at least the source's routed rows, which are the first ones)."""
    _check_sizes(window, tile)
    start_sdg, _ = order_starts(t)
    counts_e = t.counts_se[source]
    ends_e = jnp.cumsum(counts_e, dtype=jnp.int32)
    row_n = jnp.arange(num_rows, dtype=jnp.int32)
    expert_n = jnp.searchsorted(ends_e, row_n, side="right", method="scan_unrolled")
    valid_n = expert_n < counts_e.shape[0]
    expert_n = jnp.minimum(expert_n, counts_e.shape[0] - 1).astype(jnp.int32)
    dest_n, local_n = expert_n // t.num_local, expert_n % t.num_local
    rank_n = row_n - (ends_e - counts_e)[expert_n]
    position_n = start_sdg[source, dest_n, local_n] + rank_n
    round_n = position_n // window
    lo_ng, _, tile_start_ng = _round_runs(t, dest_n, round_n, window, tile)
    pick = functools.partial(jnp.take_along_axis, indices=local_n[:, None], axis=1)
    slot_n = pick(tile_start_ng)[:, 0] * tile + position_n - pick(lo_ng)[:, 0]
    invalid = jnp.int32(-1)
    return RowPlaces(
        dest_n=jnp.where(valid_n, dest_n, invalid),
        expert_n=jnp.where(valid_n, local_n, invalid),
        round_n=jnp.where(valid_n, round_n, invalid),
        slot_n=jnp.where(valid_n, slot_n, invalid),
    )


def _piece_tiles(t: Traffic, dest: Array, round_index: Array, window: int, tile: int):
    """Each (source, local expert)'s rows at receiver `dest` in round r, as tiles: (first_sg,
    last_sg, nonempty_sg) [EP, G]."""
    _check_sizes(window, tile)
    start_sdg, _ = order_starts(t)
    start_sg = start_sdg[:, dest]
    lo_g, hi_g, tile_start_g = _round_runs(t, dest, round_index, window, tile)
    a_sg = jnp.clip(start_sg, lo_g, hi_g)
    b_sg = jnp.clip(start_sg + _counts_sdg(t)[:, dest], lo_g, hi_g)
    base_g = tile_start_g * tile - lo_g
    first_sg = (base_g + a_sg) // tile
    last_sg = (base_g + b_sg - 1) // tile
    return first_sg, last_sg, b_sg > a_sg


def tile_arrivals(t: Traffic, dest: Array, round_index: Array, window: int, tile: int) -> Array:
    """int32 [U]: the pieces receiver `dest` waits for in each tile of round r (0: unused)."""
    first_sg, last_sg, nonempty_sg = _piece_tiles(t, dest, round_index, window, tile)
    tile_u = jnp.arange(num_tiles(window, tile, t.num_local), dtype=jnp.int32)
    covers = (first_sg[..., None] <= tile_u) & (tile_u <= last_sg[..., None])
    return jnp.sum(covers & nonempty_sg[..., None], axis=(0, 1), dtype=jnp.int32)


def return_arrivals(t: Traffic, source: Array, round_index: Array, window: int, tile: int) -> Array:
    """int32 [EP]: the pieces source s gets back from each receiver in round r."""
    num_devices = t.counts_se.shape[0]

    def from_dest(dest):
        first_sg, last_sg, nonempty_sg = _piece_tiles(t, dest, round_index, window, tile)
        pieces_g = jnp.where(nonempty_sg[source], last_sg[source] - first_sg[source] + 1, 0)
        return jnp.sum(pieces_g, dtype=jnp.int32)

    return jax.vmap(from_dest)(jnp.arange(num_devices, dtype=jnp.int32))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["row_p", "slot_p", "size_p", "dest_p", "round_p", "tile_p", "count"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Pieces:
    """A source's pieces in row order (int32 [P] each, P = N: at most one a row). The first
    `count` (int32 []) are real; the rest have size 0 and dest, round and tile -1.

    Attributes:
      row_p: the piece's first row among the source's sorted rows.
      slot_p: its first slot in the receiver's buffer.
      size_p: its rows (at most the tile's).
      dest_p, round_p, tile_p: its receiver, round and tile there.
    """

    row_p: Array
    slot_p: Array
    size_p: Array
    dest_p: Array
    round_p: Array
    tile_p: Array
    count: Array


def true_first(mask_n: Array) -> Array:
    """int32 [n]: the indices where mask_n holds, in increasing order, then zeros: the first
    part of `argsort(~mask_n, stable=True)`, from a prefix sum and a scatter to distinct
    positions (linear in n, where the sort was n log n; the exchange's tables compact EP x N
    rows per source this way)."""
    n = mask_n.shape[0]
    index_n = jnp.arange(n, dtype=jnp.int32)
    rank_n = jnp.cumsum(mask_n, dtype=jnp.int32) - 1
    position_n = jnp.where(mask_n, rank_n, n)  # past the end: dropped
    return jnp.zeros((n,), jnp.int32).at[position_n].set(index_n, mode="drop")


def pieces(places: RowPlaces, tile: int) -> Pieces:
    """The pieces of a source's rows: maximal runs of rows with one (receiver, round, tile)
    and consecutive slots. Routed rows are a prefix of the rows (the padding is last)."""
    _check_sizes(1, tile)
    valid_n = places.dest_n >= 0
    tile_n = jnp.where(valid_n, places.slot_n // tile, -1)

    def before(a):  # each row's predecessor's value (-2 before the first: matches nothing)
        return jnp.concatenate([jnp.full((1,), -2, a.dtype), a[:-1]])

    continues_n = (
        (before(places.dest_n) == places.dest_n)
        & (before(places.round_n) == places.round_n)
        & (before(tile_n) == tile_n)
        & (before(places.slot_n) + 1 == places.slot_n)
    )
    starts_n = valid_n & ~continues_n
    count = jnp.sum(starts_n, dtype=jnp.int32)
    # Start rows first, in row order.
    row_p = true_first(starts_n)
    real_p = jnp.arange(row_p.shape[0], dtype=jnp.int32) < count
    routed = jnp.sum(valid_n, dtype=jnp.int32)
    next_p = jnp.where(real_p[1:], row_p[1:], routed)
    size_p = jnp.where(real_p, jnp.concatenate([next_p, routed[None]]) - row_p, 0)

    def at_start(a_n):
        return jnp.where(real_p, a_n[row_p], -1)

    return Pieces(
        row_p=jnp.where(real_p, row_p, 0),
        slot_p=jnp.where(real_p, places.slot_n[row_p], 0),
        size_p=size_p,
        dest_p=at_start(places.dest_n),
        round_p=at_start(places.round_n),
        tile_p=at_start(tile_n),
        count=count,
    )


def buffer_layout(
    t: Traffic, dest: Array, round_index: Array, window: int, tile: int
) -> tuple[Array, Array]:
    """Receiver `dest`'s buffer in round r as grouped rows: (group_sizes_g int32 [G], each
    local expert's run padded to whole tiles, in expert order from slot 0; filled_s bool [S],
    the slots a row lands in). S = num_tiles * tile; slots past the groups are empty."""
    lo_g, hi_g, tile_start_g = _round_runs(t, dest, round_index, window, tile)
    length_g = hi_g - lo_g
    group_sizes_g = (length_g + tile - 1) // tile * tile
    slot_s = jnp.arange(num_tiles(window, tile, t.num_local) * tile, dtype=jnp.int32)
    ends_g = jnp.cumsum(group_sizes_g, dtype=jnp.int32)
    g_s = jnp.searchsorted(ends_g, slot_s, side="right", method="scan_unrolled")
    g_s = jnp.minimum(g_s, t.num_local - 1)
    filled_s = slot_s - tile_start_g[g_s] * tile < length_g[g_s]
    filled_s &= slot_s >= tile_start_g[g_s] * tile
    return group_sizes_g.astype(jnp.int32), filled_s


def exchange_pieces(
    t: Traffic, me: Array, num_rows: int, window: int, tile: int
) -> tuple[Moves, Moves]:
    """Device `me`'s copies of every round: (dispatch, back), each copy with its round. Their
    counts of a round (arrivals, zero ranges) are `exchange_round`'s; here they are zeros.

    dispatch: its pieces (sorted rows -> the receivers' buffer slots), counted on the
    receiver's tile. back: the return, which is also the dispatch's gradient: every piece it
    receives, from its buffer slots back to the source's rows, counted on the source's one
    counter. The return's tables are every source's pieces to `me` (from the counts alone, as
    everything here): EP sorts of N rows and one of EP * N pieces, once for all rounds.
    """
    num_devices = t.counts_se.shape[0]
    sources = jnp.arange(num_devices, dtype=jnp.int32)
    every = jax.vmap(lambda s: pieces(row_places(t, s, num_rows, window, tile), tile))(sources)
    mine = jax.tree.map(lambda a: a[me], every)
    dispatch = Moves(
        src_p=mine.row_p,
        dst_p=mine.slot_p,
        size_p=mine.size_p,
        peer_p=mine.dest_p,
        round_p=mine.round_p,
        counter_p=mine.tile_p,
        count=mine.count,
        arrivals_c=jnp.zeros((num_tiles(window, tile, t.num_local),), jnp.int32),
        zero_dst_z=jnp.zeros((t.num_local + TAIL_RANGES,), jnp.int32),
        zero_size_z=jnp.zeros((t.num_local + TAIL_RANGES,), jnp.int32),
    )
    real_sp = jnp.arange(num_rows) < every.count[:, None]
    to_me_sp = real_sp & (every.dest_p == me)
    # The pieces to me first, in (source, row) order.
    order = true_first(to_me_sp.reshape(-1))
    count = jnp.sum(to_me_sp, dtype=jnp.int32)
    real_c = jnp.arange(order.shape[0]) < count

    def take(a_sp, fill=0):
        return jnp.where(real_c, a_sp.reshape(-1)[order], fill)

    back = Moves(
        src_p=take(every.slot_p),
        dst_p=take(every.row_p),
        size_p=take(every.size_p),
        peer_p=take(jnp.broadcast_to(sources[:, None], real_sp.shape)),
        round_p=take(every.round_p, -1),
        counter_p=jnp.zeros_like(order),
        count=count,
        arrivals_c=jnp.zeros((1,), jnp.int32),
        zero_dst_z=jnp.zeros((1,), jnp.int32),
        zero_size_z=jnp.zeros((1,), jnp.int32),
    )
    return dispatch, back


def exchange_round(
    t: Traffic, me: Array, round_index: Array, window: int, tile: int, moves: tuple[Moves, Moves]
) -> tuple[Moves, Moves]:
    """`exchange_pieces`' tables with round r's counts: the dispatch's arrivals are
    `tile_arrivals` (the pieces each of `me`'s tiles gets) and its zero ranges the slots of
    `me`'s buffer inside the groups that no row fills (each local expert's last tile past its
    rows), so that the grouped GEMMs sum zeros there, forward and backward, and the first
    TAIL_ZERO_ROWS slots past the groups, which the weight gradients' kernel reads (as
    TAIL_RANGES ranges; the slots after them are left unspecified); the return's one counter
    gets `me`'s own pieces of the round, each of which comes back once."""
    dispatch, back = moves
    lo_g, hi_g, tile_start_g = _round_runs(t, me, round_index, window, tile)
    length_g = hi_g - lo_g
    pad_g = (-length_g) % tile
    end = jnp.sum(length_g + pad_g, dtype=jnp.int32)[None]
    slots = num_tiles(window, tile, t.num_local) * tile
    real_p = jnp.arange(dispatch.src_p.shape[0]) < dispatch.count
    mine_in_round = jnp.sum(real_p & (dispatch.round_p == round_index), dtype=jnp.int32)
    tail_dst_r, tail_size_r = _tail_ranges(end[0], jnp.minimum(end[0] + TAIL_ZERO_ROWS, slots))
    dispatch = dataclasses.replace(
        dispatch,
        arrivals_c=tile_arrivals(t, me, round_index, window, tile),
        zero_dst_z=jnp.concatenate([tile_start_g * tile + length_g, tail_dst_r]).astype(jnp.int32),
        zero_size_z=jnp.concatenate([pad_g, tail_size_r]).astype(jnp.int32),
    )
    return dispatch, dataclasses.replace(back, arrivals_c=mine_in_round[None])


def _tail_ranges(start: Array, stop: Array) -> tuple[Array, Array]:
    """Slots [start, stop) as TAIL_RANGES consecutive ranges (dst, size) of int32 [TAIL_RANGES]
    each, of equal size but the last (empty ranges start at `stop`)."""
    part = (stop - start + TAIL_RANGES - 1) // TAIL_RANGES
    dst_r = jnp.minimum(start + jnp.arange(TAIL_RANGES, dtype=jnp.int32) * part, stop)
    size_r = jnp.minimum(part, stop - dst_r)
    return dst_r.astype(jnp.int32), size_r.astype(jnp.int32)


def exchange_moves(
    t: Traffic, me: Array, round_index: Array, num_rows: int, window: int, tile: int
) -> tuple[Moves, Moves]:
    """Device `me`'s copies in round r, (dispatch, back): `exchange_pieces` with round r's
    counts (`exchange_round`). A loop over rounds builds the pieces once instead."""
    moves = exchange_pieces(t, me, num_rows, window, tile)
    return exchange_round(t, me, round_index, window, tile, moves)
