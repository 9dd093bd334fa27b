"""The routed experts of one device: dispatch, expert GEMMs and return, in rounds.

    y_nd, rounds = routed_experts(x_nd, (w_gate, w_up, w_down), group_sizes_e, spec, scale_n)

x_nd are this device's N routed rows sorted by expert (so by destination device); the result
is each row's expert output, f32, in the same order. Per round:

  dispatch  rows travel to the devices owning their experts   (`exchange.transfer` or ppermute)
  experts   tiled SwiGLU over the received rows               (`tiles.tiled_experts`)
  return    results travel back to the rows' devices

With kernel "fused" the rows move inside kernels instead: each round's dispatch and
return are Mosaic GPU kernels of remote copies and semaphores (`pallas_kernels.exchange`; on the
CPU their all_gather spec), into the tile-aligned expert-major buffer of
`pallas_kernels.exchange.protocol`, whose groups the grouped-GEMM kernels read as they are; each
row's routing weight travels with it and is applied in the down projection's epilogue, as on one
device, so y and dx are the bits of the single-device `fused` implementation.

The round count depends on the routing, so the loop is a `fori_loop` with a traced bound (a
while loop), which reverse-mode autodiff cannot go through. `routed_experts` is therefore a
`custom_vjp`: the backward runs the same rounds, recomputing each round's forward under
`jax.vjp` (memory stays one round's worth) and adding the rounds' weight gradients in round
order, in f32. With kernel "fused" the backward reads nothing of that forward
(`pallas_kernels.exchange.ops` saves the rows and dispatches them again inside the backward's
first GEMM's kernel): it is dead code, which XLA drops (a count of the compiled kernels showed
it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from mok_jax import exchange
from mok_jax.config import Exchange
from mok_jax.options import ExchangeFusion, Recompute, current_target
from mok_jax.permute import take_rows
from mok_jax.tiles import tile_layout, tiled_experts
from pallas_kernels.exchange import protocol
from pallas_kernels.mesh import vary, varying_axes


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutedSpec:
    """Static facts of one device's routed experts (hashable).

    Attributes:
      axis: the expert mesh axis, None on one device.
      rounds_axes: every mesh axis (the round count is agreed over all of them).
      num_devices: EP, devices on the expert axis.
      num_local: G, experts per device.
      exchange: "ragged_all_to_all" (windows) or "ring" (chunks per hop).
      buffer_rows: the window (rows a device receives per round) or the ring's chunk.
      row_tile: rows per expert tile.
      dtype: the compute dtype.
      kernel: "xla" (batched dots), "pallas" (the Mosaic GPU grouped GEMMs) or "fused" (the
        exchange inside kernels, `exchange` ignored; the rows come with their routing weights).
      recompute, exchange_tile, exchange_programs, exchange_fusion: with "fused", the
        `MoEOptions` of those names (resolved): how the backward recomputes gate and up; rows
        per tile of the receive buffer; the programs of the first and last GEMMs' kernels
        (forward and backward) that run the exchange's copies (0: kernels of their own);
        which kernels carry the copies. None otherwise.
    """

    axis: str | None
    rounds_axes: tuple[str, ...]
    num_devices: int
    num_local: int
    exchange: Exchange
    buffer_rows: int
    row_tile: int
    dtype: np.dtype
    kernel: Literal["xla", "pallas", "fused"] = "xla"
    recompute: Recompute | None = None
    exchange_tile: int | None = None
    exchange_programs: int | None = None
    exchange_fusion: ExchangeFusion | None = None


def _me(spec: RoutedSpec) -> Array:
    if spec.axis is None:
        return jnp.zeros((), jnp.int32)
    return lax.axis_index(spec.axis).astype(jnp.int32)


def _agreed(rounds: Array, spec: RoutedSpec) -> Array:
    return lax.pmax(rounds, spec.rounds_axes) if spec.rounds_axes else rounds


def _experts(x_rd, weights, experts_r, spec: RoutedSpec) -> Array:
    with jax.named_scope("experts"):
        layout = tile_layout(experts_r, spec.num_local, spec.row_tile)
        return tiled_experts(x_rd, *weights, layout, spec.dtype, spec.kernel)


def _window_round(r, x_nd, weights, t: protocol.Traffic, spec: RoutedSpec) -> Array:
    """Round r of the windowed exchange: -> f32 [N, D], nonzero on the rows of round r."""
    me, window = _me(spec), spec.buffer_rows
    tr = exchange.window_transfer(t, me, r, window)
    # One device on the expert axis: the window is a slice of the rows, no collective (a
    # ragged_all_to_all of a 1-device axis cost ~145 ms at qwen3 T 4096 on the H200).
    local = spec.axis is None or spec.num_devices == 1
    with jax.named_scope("dispatch"):
        if local:
            x_wd = take_rows(x_nd, *_local_window(tr, x_nd.shape[0], window))
        else:
            x_wd = exchange.transfer(x_nd, tr, window, spec.axis)
    y_wd = _experts(x_wd, weights, exchange.window_experts(t, me, r, window), spec)
    with jax.named_scope("return"):
        if local:
            return take_rows(y_wd, *_local_window(tr, x_nd.shape[0], window)[::-1])
        return exchange.transfer(y_wd, tr.reversed(), x_nd.shape[0], spec.axis)


def _local_window(tr: exchange.Transfer, num_rows: int, window: int) -> tuple[Array, Array]:
    """One device: the window is a slice of the rows. (window -> row map, row -> window map)."""
    lane_w = jnp.arange(window, dtype=jnp.int32)
    row_w = jnp.where(lane_w < tr.send_sizes[0], tr.send_offsets[0] + lane_w, -1)
    lane_n = jnp.arange(num_rows, dtype=jnp.int32) - tr.send_offsets[0]
    window_n = jnp.where((lane_n >= 0) & (lane_n < tr.send_sizes[0]), lane_n, -1)
    return row_w, window_n


def _ring_round(r, x_nd, weights, t: protocol.Traffic, spec: RoutedSpec) -> Array:
    """Round r of the ring: hop h sends my chunk for device me+h and computes the chunk from
    me-h; the GEMMs of one hop overlap the next hop's transfer. -> f32 [N, D]."""
    me, ep, chunk = _me(spec), spec.num_devices, spec.buffer_rows
    num_rows = x_nd.shape[0]
    dest_n = _dest_of_rows(t, me, num_rows)
    y_nd = jnp.zeros((num_rows, x_nd.shape[1]), jnp.float32)
    for hop in range(ep):
        dest, source = (me + hop) % ep, (me - hop) % ep
        index_c, _ = exchange.chunk_rows(t, me, dest, r, chunk)
        rank_n = jnp.arange(num_rows, dtype=jnp.int32) - t.send_start_sd[me, dest] - r * chunk
        mine_n = (dest_n == dest) & (rank_n >= 0) & (rank_n < chunk)
        inverse_n = jnp.where(mine_n, rank_n, -1)
        with jax.named_scope("dispatch"):
            x_cd = take_rows(x_nd, index_c, inverse_n)
            if hop:
                x_cd = lax.ppermute(x_cd, spec.axis, [(i, (i + hop) % ep) for i in range(ep)])
        _, experts_c = exchange.chunk_rows(t, source, me, r, chunk)
        y_cd = _experts(x_cd, weights, experts_c, spec)
        with jax.named_scope("return"):
            if hop:
                y_cd = lax.ppermute(y_cd, spec.axis, [(i, (i - hop) % ep) for i in range(ep)])
            y_nd = jnp.where(mine_n[:, None], take_rows(y_cd, inverse_n, index_c), y_nd)
    return y_nd


def _fused_round(r, rows, weights, plan, spec: RoutedSpec) -> Array:
    """Round r with the exchange inside kernels: rows (x [N, D], routing weights f32 [N]) ->
    weighted results f32 [N, D] on the rows of round r (the other rows unspecified). plan:
    `_fused_plan`'s."""
    from pallas_kernels.exchange import ops as exchange_ops

    x_nd, scale_n = rows
    t, moves, _ = plan
    me, window, tile = _me(spec), spec.buffer_rows, spec.exchange_tile
    slots = protocol.num_tiles(window, tile, spec.num_local) * tile
    dispatch, back = protocol.exchange_round(t, me, r, window, tile, moves)
    group_sizes_g, _ = protocol.buffer_layout(t, me, r, window, tile)
    # Every slot inside the groups that no row fills (an expert's last tile past its rows)
    # comes out of the dispatch as zeros, and so does the results' cotangent there (the
    # dispatch's zero ranges): zero rows add nothing to the weights' gradients, which sum over
    # whole row tiles. So do the first slots past the groups, which the weight gradients'
    # kernel reads (protocol.TAIL_ZERO_ROWS); the slots after them are unspecified:
    # the GEMMs compute rows they load there and never store them, and the weight gradients
    # mask them out with a select (NaN there stays out). Rows of other rounds are
    # unspecified: `_rounds` keeps each row's own round.
    with jax.named_scope("exchange_experts"):
        return exchange_ops.dispatch_mlp(
            x_nd,
            scale_n,
            dispatch,
            back,
            r,
            *(w.astype(spec.dtype) for w in weights),
            group_sizes_g,
            out_rows=slots,
            tile=tile,
            axis_name=spec.axis,
            recompute=spec.recompute,
            exchange_programs=spec.exchange_programs,
            exchange_fusion=spec.exchange_fusion,
            interpret=current_target().interpret,
        )


def _dest_of_rows(t: protocol.Traffic, me: Array, num_rows: int) -> Array:
    ends_d = t.send_start_sd[me] + t.send_sd[me]
    row_n = jnp.arange(num_rows, dtype=jnp.int32)
    return jnp.searchsorted(ends_d, row_n, side="right", method="scan_unrolled").astype(jnp.int32)


def _fused_plan(t: protocol.Traffic, num_rows: int, spec: RoutedSpec):
    """kernel "fused": (traffic, the exchange's (dispatch, back) pieces of every round, the
    round of each row), built once for all the rounds."""
    me, window, tile = _me(spec), spec.buffer_rows, spec.exchange_tile
    pieces = protocol.exchange_pieces(t, me, num_rows, window, tile)
    round_n = protocol.row_places(t, me, num_rows, window, tile).round_n
    return t, pieces, round_n


def _plan_rounds(t, num_rows: int, spec: RoutedSpec):
    """(round function, rounds, round of each row) for this exchange. t: the traffic, or with
    kernel "fused" `_fused_plan`'s."""
    me = _me(spec)
    if spec.kernel == "fused":
        t, _, round_n = t
        return _fused_round, protocol.window_rounds(t, spec.buffer_rows), round_n
    dest_n = _dest_of_rows(t, me, num_rows)
    if spec.exchange == "ring" and spec.axis is not None:
        rank_n = jnp.arange(num_rows, dtype=jnp.int32) - t.send_start_sd[me, dest_n]
        return _ring_round, exchange.chunk_rounds(t, spec.buffer_rows), rank_n // spec.buffer_rows
    round_n = exchange.row_window_round(t, me, dest_n, spec.buffer_rows)
    return _window_round, protocol.window_rounds(t, spec.buffer_rows), round_n


def _counts(group_sizes_e: Array, spec: RoutedSpec) -> protocol.Traffic:
    if spec.axis is None:
        counts_se = group_sizes_e[None]
    else:
        counts_se = lax.all_gather(group_sizes_e, spec.axis)
    return protocol.traffic(counts_se, spec.num_local)


def routed_experts(
    x_nd: Array,
    weights: tuple[Array, Array, Array],
    group_sizes_e: Array,
    spec: RoutedSpec,
    scale_n: Array | None = None,
) -> tuple[Array, Array]:
    """This device's sorted rows x [N, D] through their experts -> (f32 [N, D], rounds int32 []).

    weights: (w_gate [G, D, F], w_up [G, D, F], w_down [G, F, D]), this device's experts.
    group_sizes_e: int32 [E], this device's rows per (global) expert.
    scale_n: f32 [N], each row's routing weight (kernel "fused" only, which needs it): the
      results come back multiplied by it, and it gets a gradient.
    """
    if (scale_n is not None) != (spec.kernel == "fused"):
        raise ValueError(f"scale_n must be given with kernel 'fused' only (kernel={spec.kernel!r})")
    if spec.kernel == "fused" and spec.axis is None:
        raise ValueError("kernel 'fused' exchanges along a mesh axis: spec.axis must be set")
    fused_fields = (
        spec.recompute,
        spec.exchange_tile,
        spec.exchange_programs,
        spec.exchange_fusion,
    )
    if spec.kernel == "fused" and None in fused_fields:
        raise ValueError(f"kernel 'fused' needs its resolved options in the spec: {spec}")
    t = _counts(group_sizes_e, spec)
    if spec.kernel == "fused":
        t = _fused_plan(t, x_nd.shape[0], spec)
    _, rounds, _ = _plan_rounds(t, x_nd.shape[0], spec)
    rounds = _agreed(rounds, spec)
    # The weights meet rows of every device: let them vary where the rows do, so their
    # gradients come back summed over the data axis.
    weights = tuple(vary(w, varying_axes(x_nd)) for w in weights)
    rows = x_nd.astype(spec.dtype)
    if scale_n is not None:
        rows = (rows, scale_n.astype(jnp.float32))
    return _rounds(rows, weights, t, rounds, spec), rounds


def _pick(mask_n: Array, new, old):
    """Rows of `new` where mask_n, else of `old` (arrays [N, ...] or pytrees of them)."""

    def pick(a, b):
        return jnp.where(mask_n.reshape(-1, *(1,) * (a.ndim - 1)), a, b)

    return jax.tree.map(pick, new, old)


def _num_rows(rows) -> int:
    return jax.tree.leaves(rows)[0].shape[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _rounds(rows, weights, t, rounds, spec: RoutedSpec):
    round_fn, _, round_n = _plan_rounds(t, _num_rows(rows), spec)

    def body(r, y_nd):
        return _pick(round_n == r, round_fn(r, rows, weights, t, spec), y_nd)

    y_nd = round_fn(jnp.zeros((), jnp.int32), rows, weights, t, spec)
    return lax.fori_loop(1, rounds, body, y_nd)


def _rounds_fwd(rows, weights, t, rounds, spec):
    return _rounds(rows, weights, t, rounds, spec), (rows, weights, t, rounds)


def _rounds_bwd(spec, residuals, g_nd):
    rows, weights, t, rounds = residuals
    round_fn, _, round_n = _plan_rounds(t, _num_rows(rows), spec)

    def round_vjp(r):
        # (d_rows, dweights in the weights' dtype). d_rows of other rounds' rows: zeros, or
        # unspecified where the exchange's kernels left them; each row keeps its own round's
        # below.
        _, vjp = jax.vjp(lambda x, w: round_fn(r, x, w, t, spec), rows, weights)
        return vjp(g_nd)

    def body(r, carry):
        d_rows, dweights = carry
        d_rows_r, dweights_r = round_vjp(r)
        d_rows = _pick(round_n == r, d_rows_r, d_rows)
        dweights_r = tuple(dw.astype(jnp.float32) for dw in dweights_r)
        return d_rows, tuple(a + b for a, b in zip(dweights, dweights_r, strict=True))

    def later_rounds(carry):
        # The weights' gradients add up round by round in f32, then round once.
        d_rows, dweights = carry
        dweights = tuple(dw.astype(jnp.float32) for dw in dweights)
        d_rows, dweights = lax.fori_loop(1, rounds, body, (d_rows, dweights))
        return d_rows, tuple(dw.astype(w.dtype) for dw, w in zip(dweights, weights, strict=True))

    # One round (the common case, with a buffer above the load) takes round 0's gradients as
    # they are: the weights' round trip through f32 changes no bits there, and with bf16
    # weights it cost six weight-sized converts, 1.72 ms of a 16.9 ms forward+backward at
    # qwen3 on one H200 (bench/results/2026-12-02_exchange_one_kernel_forward_h200/). Every
    # device agrees on `rounds`, so all take the same branch.
    d_rows, dweights = lax.cond(
        rounds > 1, later_rounds, lambda carry: carry, round_vjp(jnp.zeros((), jnp.int32))
    )
    # Rows of round 0 hold round 0's, later rounds put theirs in place; rows of no round get
    # zeros. One select after the rounds, not one a round.
    in_a_round = (round_n >= 0) & (round_n < rounds)
    d_rows = _pick(in_a_round, d_rows, jax.tree.map(jnp.zeros_like, d_rows))
    return d_rows, dweights, None, None


_rounds.defvjp(_rounds_fwd, _rounds_bwd)
