"""The routed experts of one device: dispatch, expert GEMMs and return, in rounds.

    y_nd = routed_experts(x_nd, w_gate, w_up, w_down, counts_se, spec)

x_nd are this device's N routed rows sorted by expert (so by destination device); the result
is each row's expert output, f32, in the same order. Per round:

  dispatch  rows travel to the devices owning their experts   (`exchange.transfer` or ppermute)
  experts   tiled SwiGLU over the received rows               (`tiles.tiled_experts`)
  return    results travel back to the rows' devices

The round count depends on the routing, so the loop is a `while_loop`, which reverse-mode
autodiff cannot go through. `routed_experts` is therefore a `custom_vjp`: the backward runs the
same rounds, recomputing each round's forward under `jax.vjp` (memory stays one round's worth)
and adding the rounds' weight gradients in round order, in f32.
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
from mok_jax.permute import take_rows
from mok_jax.tiles import tile_layout, tiled_experts, vary, varying_axes


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
      kernel: "xla" (batched dots) or "pallas" (the Mosaic GPU grouped GEMMs).
    """

    axis: str | None
    rounds_axes: tuple[str, ...]
    num_devices: int
    num_local: int
    exchange: Exchange
    buffer_rows: int
    row_tile: int
    dtype: np.dtype
    kernel: Literal["xla", "pallas"] = "xla"


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


def _window_round(r, x_nd, weights, t: exchange.Traffic, spec: RoutedSpec) -> Array:
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


def _ring_round(r, x_nd, weights, t: exchange.Traffic, spec: RoutedSpec) -> Array:
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


def _dest_of_rows(t: exchange.Traffic, me: Array, num_rows: int) -> Array:
    ends_d = t.send_start_sd[me] + t.send_sd[me]
    row_n = jnp.arange(num_rows, dtype=jnp.int32)
    return jnp.searchsorted(ends_d, row_n, side="right", method="scan_unrolled").astype(jnp.int32)


def _plan_rounds(t: exchange.Traffic, num_rows: int, spec: RoutedSpec):
    """(round function, rounds, round of each row) for this exchange."""
    me = _me(spec)
    dest_n = _dest_of_rows(t, me, num_rows)
    if spec.exchange == "ring" and spec.axis is not None:
        rank_n = jnp.arange(num_rows, dtype=jnp.int32) - t.send_start_sd[me, dest_n]
        return _ring_round, exchange.chunk_rounds(t, spec.buffer_rows), rank_n // spec.buffer_rows
    round_n = exchange.row_window_round(t, me, dest_n, spec.buffer_rows)
    return _window_round, exchange.window_rounds(t, spec.buffer_rows), round_n


def _counts(group_sizes_e: Array, spec: RoutedSpec) -> exchange.Traffic:
    if spec.axis is None:
        counts_se = group_sizes_e[None]
    else:
        counts_se = lax.all_gather(group_sizes_e, spec.axis)
    return exchange.traffic(counts_se, spec.num_local)


def routed_experts(
    x_nd: Array, weights: tuple[Array, Array, Array], group_sizes_e: Array, spec: RoutedSpec
) -> tuple[Array, Array]:
    """This device's sorted rows x [N, D] through their experts -> (f32 [N, D], rounds int32 []).

    weights: (w_gate [G, D, F], w_up [G, D, F], w_down [G, F, D]), this device's experts.
    group_sizes_e: int32 [E], this device's rows per (global) expert.
    """
    t = _counts(group_sizes_e, spec)
    _, rounds, _ = _plan_rounds(t, x_nd.shape[0], spec)
    rounds = _agreed(rounds, spec)
    # The weights meet rows of every device: let them vary where the rows do, so their
    # gradients come back summed over the data axis.
    weights = tuple(vary(w, varying_axes(x_nd)) for w in weights)
    return _rounds(x_nd.astype(spec.dtype), weights, t, rounds, spec), rounds


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _rounds(x_nd, weights, t, rounds, spec: RoutedSpec):
    round_fn, _, round_n = _plan_rounds(t, x_nd.shape[0], spec)

    def body(r, y_nd):
        y_r = round_fn(r, x_nd, weights, t, spec)
        return jnp.where((round_n == r)[:, None], y_r, y_nd)

    y_nd = round_fn(jnp.zeros((), jnp.int32), x_nd, weights, t, spec)
    return lax.fori_loop(1, rounds, body, y_nd)


def _rounds_fwd(x_nd, weights, t, rounds, spec):
    return _rounds(x_nd, weights, t, rounds, spec), (x_nd, weights, t, rounds)


def _rounds_bwd(spec, residuals, g_nd):
    x_nd, weights, t, rounds = residuals
    round_fn, _, round_n = _plan_rounds(t, x_nd.shape[0], spec)

    def round_vjp(r):
        _, vjp = jax.vjp(lambda x, w: round_fn(r, x, w, t, spec), x_nd, weights)
        dx_nd, dweights = vjp(g_nd)
        return dx_nd, tuple(dw.astype(jnp.float32) for dw in dweights)

    def body(r, carry):
        dx_nd, dweights = carry
        dx_r, dweights_r = round_vjp(r)
        dx_nd = jnp.where((round_n == r)[:, None], dx_r, dx_nd)
        return dx_nd, tuple(a + b for a, b in zip(dweights, dweights_r, strict=True))

    carry = lax.fori_loop(1, rounds, body, round_vjp(jnp.zeros((), jnp.int32)))
    dx_nd, dweights = carry
    dweights = tuple(dw.astype(w.dtype) for dw, w in zip(dweights, weights, strict=True))
    return dx_nd, dweights, None, None


_rounds.defvjp(_rounds_fwd, _rounds_bwd)
