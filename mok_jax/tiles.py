"""Fixed-shape row tiles: every row meets its weights in a dot of one shape, on any mesh.

XLA picks a dot's algorithm, and so its summation order, from the dot's shape: on CPU a
[T, D] x [D, E] product gives different bits for a row when T changes (measured on jax 0.11.2
for T <= 33, and for narrow E at any T). A row's result must not depend on how many tokens or
experts a device holds, so every dot here has a shape fixed by the config alone:

  token dots   [TILES_PER_STEP * row_tile, D] x [D, N], one loop step per chunk of tokens
               (the shared experts: the batch-1 form of the expert dots below)
  expert dots  [TILES_PER_STEP, row_tile, D] x [TILES_PER_STEP, D, F], one expert per tile

Expert groups are padded to whole tiles, each starting at its group's first row, so a tile holds
the same rows of the same expert whatever the expert-parallel degree.

Invariants:
  1. A row's forward result and its input gradient are the same bits for every tile count.
  2. Weight gradients accumulate tile by tile, in tile order, in f32 (no scatter-add); tiles of
     one expert are in row order, so the order is the rows' order.
  3. Padding rows are zeros. Used tiles are a prefix of the tiles (see `TileLayout`), and the
     expert loops run only the steps that hold one, forward and backward: a receive buffer's
     empty tiles cost nothing.

Reverse mode is first order only: the expert loops' trip count is data dependent (as is the
round count in routed.py), and the shared experts' SwiGLU is a custom VJP. Weight gradients are
returned in the weights' dtype, so with bf16 parameters each device's sum is rounded before the
sum over devices; with f32 parameters (the default) nothing depends on tokens per device but the
order of that last sum.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from mok_jax.experts import dot_precision, swiglu
from mok_jax.options import current_target
from mok_jax.permute import take_rows
from mok_jax.plan import id_bounds
from pallas_kernels.mesh import vary, varying_axes

# Tiles per loop step: every loop step computes a dot of this many tiles.
TILES_PER_STEP = 8
# Loops run at least this many steps (see token_tiled).
MIN_STEPS = 2


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _dot(a: Array, b: Array, dtype: np.dtype) -> Array:
    return jnp.dot(
        a.astype(dtype),
        b.astype(dtype),
        precision=dot_precision(dtype),
        preferred_element_type=jnp.float32,
    )


def token_chunk(token_chunk: int | None, row_tile: int) -> int:
    """C, the tokens a chunk of the token-wise stages: `token_chunk`, or for None the CPU's
    automatic chunk, TILES_PER_STEP * row_tile (the layer itself reads MoEOptions.token_chunk,
    resolved by `mok_jax.resolve`)."""
    return token_chunk if token_chunk is not None else TILES_PER_STEP * row_tile


def _token_chunks(num_tokens: int, chunk: int) -> tuple[int, int]:
    """(chunk, padded): C tokens a chunk, T padded to whole chunks. At least two loop steps:
    XLA inlines a one-step loop, and the inlined body may be fused (FMA-contracted)
    differently from the loop body, which changes last bits."""
    return chunk, max(_round_up(num_tokens, chunk), MIN_STEPS * chunk)


def _to_chunks(a: Array, chunk: int, padded: int) -> Array:
    """[T, ...] -> [padded / C, C, ...], zero-padded."""
    a = jnp.pad(a, ((0, padded - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))
    return a.reshape(padded // chunk, chunk, *a.shape[1:])


def _from_chunks(a: Array, num_tokens: int) -> Array:
    return a.reshape(-1, *a.shape[2:])[:num_tokens]


def token_tiled(fn, xs, chunk: int):
    """Applies the token-wise `fn` to chunks of C = `chunk` tokens (zero-padded; see
    `token_chunk`), so that every operation inside `fn`, its reductions over a token's values
    and their gradients included, has the same shape on every mesh.

    xs: an array [T, ...] or a pytree of them; fn maps such chunks [C, ...] to a pytree of
    [C, ...] arrays. Returns that pytree with [T, ...] arrays.
    """
    num_tokens = jax.tree.leaves(xs)[0].shape[0]
    chunk, padded = _token_chunks(num_tokens, chunk)
    out = lax.map(fn, jax.tree.map(lambda a: _to_chunks(a, chunk, padded), xs))
    return jax.tree.map(lambda a: _from_chunks(a, num_tokens), out)


def token_swiglu(
    x_td: Array, w_gate_df: Array, w_up_df: Array, w_down_fd: Array, dtype: np.dtype, chunk: int
) -> Array:
    """The shared experts' SwiGLU on every token, in fixed-shape chunks: -> f32 [T, D].

    Invariant 2 holds here too: the weight gradients add up chunk by chunk in f32 (a plain
    autodiff of the chunk loop would round each chunk's part to the compute dtype first, and
    the sum would then depend on how many tokens a device holds)."""
    # Inside shard_map the weights meet every device's tokens: let them vary like x, so their
    # gradients come back summed (in their own dtype) over the devices.
    weights = tuple(vary(w, varying_axes(x_td)) for w in (w_gate_df, w_up_df, w_down_fd))
    return _token_swiglu(x_td, *weights, dtype, chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _token_swiglu(x_td, w_gate_df, w_up_df, w_down_fd, dtype, chunk):
    weights = tuple(w[None] for w in (w_gate_df, w_up_df, w_down_fd))

    def chunk_fn(x_cd):
        return _step_forward(x_cd[None], *weights, dtype)[3][0]

    return token_tiled(chunk_fn, x_td, chunk)


def _token_swiglu_fwd(x_td, w_gate_df, w_up_df, w_down_fd, dtype, chunk):
    y_td = _token_swiglu(x_td, w_gate_df, w_up_df, w_down_fd, dtype, chunk)
    return y_td, (x_td, w_gate_df, w_up_df, w_down_fd)


def _token_swiglu_bwd(dtype, chunk, residuals, dy_td):
    x_td, *weights = residuals
    num_tokens = x_td.shape[0]
    chunk, padded = _token_chunks(num_tokens, chunk)
    weights_1 = tuple(w[None] for w in weights)

    def step(accs, args):
        x_cd, dy_cd = args
        dx_1cd, parts = _step_backward(x_cd[None], dy_cd[None], *weights_1, dtype)
        return tuple(acc + part[0] for acc, part in zip(accs, parts, strict=True)), dx_1cd[0]

    zeros = tuple(_zeros_varying_like(w.shape, x_td, dy_td, w) for w in weights)
    xs = (_to_chunks(x_td, chunk, padded), _to_chunks(dy_td, chunk, padded))
    dweights, dx_scd = lax.scan(step, zeros, xs)
    dx_td = _from_chunks(dx_scd, num_tokens).astype(x_td.dtype)
    return (dx_td, *(dw.astype(w.dtype) for dw, w in zip(dweights, weights, strict=True)))


_token_swiglu.defvjp(_token_swiglu_fwd, _token_swiglu_bwd)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["slot_row_q", "row_slot_r", "tile_expert_u", "tile_used_u", "tiles_g"],
    meta_fields=["row_tile"],
)
@dataclasses.dataclass(frozen=True)
class TileLayout:
    """Where R rows (each of one local expert, or of none) sit in expert tiles.

    Q = U * row_tile slots in U tiles; U is a static bound: ceil(R / row_tile) + G, rounded up
    to whole loop steps. All int32 but tile_used_u (bool).

    Attributes:
      slot_row_q: [Q] the row in each slot, -1 for padding.
      row_slot_r: [R] the slot of each row, -1 for rows of no expert.
      tile_expert_u: [U] the local expert of each tile (G-1 for unused tiles).
      tile_used_u: [U] whether the tile holds any row; the used tiles are the first
        sum(tiles_g) (tile u belongs to the expert whose tile range contains u), which the
        expert loops rely on.
      tiles_g: [G] tiles of each local expert (its tiles are consecutive, in expert order).
      row_tile: rows per tile.
    """

    slot_row_q: Array
    row_slot_r: Array
    tile_expert_u: Array
    tile_used_u: Array
    tiles_g: Array
    row_tile: int


def tile_layout(expert_r: Array, num_local: int, row_tile: int) -> TileLayout:
    """Lays out rows by expert: expert_r int32 [R] in [0, G] (G: the row is padding).

    Rows of one expert keep their order; each expert's rows start a new tile.
    """
    num_rows = expert_r.shape[0]
    num_tiles = _round_up(-(-num_rows // row_tile) + num_local, TILES_PER_STEP)
    # A static floor kept from the static loops (see token_tiled); the expert loops' trip
    # count is now data dependent, so under jit no one-step loop is inlined anyway.
    num_tiles = max(num_tiles, MIN_STEPS * TILES_PER_STEP)
    order_r = jnp.argsort(expert_r, stable=True).astype(jnp.int32)
    sorted_expert_r = expert_r[order_r]
    expert_ids = jnp.arange(num_local, dtype=jnp.int32)
    starts_g, ends_g = id_bounds(sorted_expert_r, expert_ids)
    sizes_g = ends_g - starts_g
    tiles_g = (sizes_g + row_tile - 1) // row_tile
    tile_ends_g = jnp.cumsum(tiles_g, dtype=jnp.int32)
    tile_starts_g = tile_ends_g - tiles_g
    # Slot -> row (gathers only).
    tile_u = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_expert_u = jnp.searchsorted(
        tile_ends_g, tile_u, side="right", method="scan_unrolled"
    ).astype(jnp.int32)
    tile_used_u = tile_expert_u < num_local
    tile_expert_u = jnp.minimum(tile_expert_u, num_local - 1)
    slot_q = jnp.arange(num_tiles * row_tile, dtype=jnp.int32)
    expert_q = tile_expert_u[slot_q // row_tile]
    rank_q = slot_q - tile_starts_g[expert_q] * row_tile
    slot_ok_q = tile_used_u[slot_q // row_tile] & (rank_q < sizes_g[expert_q])
    slot_row_q = jnp.where(
        slot_ok_q, order_r[jnp.clip(starts_g[expert_q] + rank_q, 0, num_rows - 1)], -1
    )
    # Row -> slot.
    inverse_r = (
        jnp.zeros_like(order_r)
        .at[order_r]
        .set(jnp.arange(num_rows, dtype=jnp.int32), unique_indices=True)
    )
    clipped_r = jnp.minimum(expert_r, num_local - 1)
    row_slot_r = tile_starts_g[clipped_r] * row_tile + inverse_r - starts_g[clipped_r]
    row_slot_r = jnp.where(expert_r < num_local, row_slot_r, -1)
    return TileLayout(
        slot_row_q=slot_row_q.astype(jnp.int32),
        row_slot_r=row_slot_r.astype(jnp.int32),
        tile_expert_u=tile_expert_u,
        tile_used_u=tile_used_u,
        tiles_g=tiles_g.astype(jnp.int32),
        row_tile=row_tile,
    )


def tiled_experts(
    x_rd: Array,
    w_gate_gdf: Array,
    w_up_gdf: Array,
    w_down_gfd: Array,
    layout: TileLayout,
    dtype: np.dtype,
    kernel: Literal["xla", "pallas"] = "xla",
) -> Array:
    """SwiGLU of each row with its expert's weights: x [R, D] -> f32 [R, D] (0 for rows of no
    expert), through the tiles of `layout`.

    kernel: "xla" runs one fixed-shape batched dot per loop step (custom VJP below); "pallas"
    runs the Mosaic GPU grouped GEMMs over the same tiles, each expert's group a whole number
    of tiles starting on a tile boundary (under GPU interpret mode on a CPU backend).
    """
    x_qd = take_rows(x_rd.astype(dtype), layout.slot_row_q, layout.row_slot_r)
    num_tiles = layout.tile_expert_u.shape[0]
    if kernel == "pallas":
        from mok_jax.experts import grouped_swiglu_pallas

        sizes_g = layout.tiles_g * layout.row_tile
        interpret = current_target().interpret
        y_qd = grouped_swiglu_pallas(
            x_qd, w_gate_gdf, w_up_gdf, w_down_gfd, sizes_g, dtype, interpret=interpret
        )
    else:
        x_utd = x_qd.reshape(num_tiles, layout.row_tile, -1)
        weights = (w_gate_gdf, w_up_gdf, w_down_gfd)
        y_utd = _tiled_swiglu(x_utd, *weights, layout.tile_expert_u, layout.tile_used_u, dtype)
        y_qd = y_utd.reshape(num_tiles * layout.row_tile, -1)
    return take_rows(y_qd, layout.row_slot_r, layout.slot_row_q)


def _steps(a: Array) -> Array:
    """[U, ...] -> [U / TILES_PER_STEP, TILES_PER_STEP, ...]."""
    return a.reshape(-1, TILES_PER_STEP, *a.shape[1:])


def _bdot(spec: str, a: Array, b: Array, dtype: np.dtype) -> Array:
    return jnp.einsum(
        spec,
        a.astype(dtype),
        b.astype(dtype),
        precision=dot_precision(dtype),
        preferred_element_type=jnp.float32,
    )


def _step_forward(x_btd, w_gate_bdf, w_up_bdf, w_down_bfd, dtype):
    gate_btf = _bdot("btd,bdf->btf", x_btd, w_gate_bdf, dtype)
    up_btf = _bdot("btd,bdf->btf", x_btd, w_up_bdf, dtype)
    h_btf = swiglu(gate_btf, up_btf).astype(dtype)
    return gate_btf, up_btf, h_btf, _bdot("btf,bfd->btd", h_btf, w_down_bfd, dtype)


def _step_backward(x_btd, dy_btd, w_gate_bdf, w_up_bdf, w_down_bfd, dtype):
    """One loop step's backward (the forward recomputed): -> (dx f32 [B, T, D], the weight
    gradients of each tile, f32: ([B, D, F], [B, D, F], [B, F, D]))."""
    gate_btf, up_btf, h_btf, _ = _step_forward(x_btd, w_gate_bdf, w_up_bdf, w_down_bfd, dtype)
    dh_btf = _bdot("btd,bfd->btf", dy_btd, w_down_bfd, dtype)
    sig_btf = jax.nn.sigmoid(gate_btf)
    dgate_btf = (dh_btf * up_btf * sig_btf * (1.0 + gate_btf * (1.0 - sig_btf))).astype(dtype)
    dup_btf = (dh_btf * gate_btf * sig_btf).astype(dtype)
    dx_btd = _bdot("btf,bdf->btd", dgate_btf, w_gate_bdf, dtype) + _bdot(
        "btf,bdf->btd", dup_btf, w_up_bdf, dtype
    )
    parts = (
        _bdot("btd,btf->bdf", x_btd, dgate_btf, dtype),
        _bdot("btd,btf->bdf", x_btd, dup_btf, dtype),
        _bdot("btf,btd->bfd", h_btf, dy_btd, dtype),
    )
    return dx_btd, parts


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _tiled_swiglu(x_utd, w_gate_gdf, w_up_gdf, w_down_gfd, tile_expert_u, tile_used_u, dtype):
    weights = (w_gate_gdf, w_up_gdf, w_down_gfd)

    def step(carry, args):
        x_btd, expert_b = args
        return carry, _step_forward(x_btd, *(w[expert_b] for w in weights), dtype)[3]

    xs = (_steps(x_utd), _steps(tile_expert_u))
    _, y_sbtd = _scan_used_steps(step, (), xs, tile_used_u)
    return y_sbtd.reshape(x_utd.shape[0], x_utd.shape[1], -1)


def _scan_used_steps(step, carry, xs, tile_used_u: Array):
    """`lax.scan(step, carry, xs)` over the loop steps that hold a used tile, in order; the
    outputs of the other steps are zeros. Used tiles come first (see `tile_layout`), so the
    loop runs ceil(used / TILES_PER_STEP) steps: the receive buffers are sized for imbalance
    (`buffer_factor`), and their empty tiles cost nothing."""
    num_steps = (jnp.sum(tile_used_u, dtype=jnp.int32) + TILES_PER_STEP - 1) // TILES_PER_STEP
    first = jax.tree.map(lambda a: a[0], xs)
    out_types = jax.eval_shape(lambda c, x: step(c, x)[1], carry, first)
    length = jax.tree.leaves(xs)[0].shape[0]
    # Inside shard_map the output buffers must vary over exactly the axes the step's outputs do.
    outs = jax.tree.map(
        lambda t: vary(
            jnp.zeros((length, *t.shape), t.dtype),
            frozenset(t.manual_axis_type.varying if t.manual_axis_type else ()),
        ),
        out_types,
    )

    def body(i, state):
        carry, outs = state
        x_i = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), xs)
        carry, y_i = step(carry, x_i)
        outs = jax.tree.map(lambda o, y: lax.dynamic_update_index_in_dim(o, y, i, 0), outs, y_i)
        return carry, outs

    return lax.fori_loop(0, num_steps, body, (carry, outs))


def _tiled_swiglu_fwd(x_utd, w_gate_gdf, w_up_gdf, w_down_gfd, tile_expert_u, tile_used_u, dtype):
    y_utd = _tiled_swiglu(
        x_utd, w_gate_gdf, w_up_gdf, w_down_gfd, tile_expert_u, tile_used_u, dtype
    )
    return y_utd, (x_utd, w_gate_gdf, w_up_gdf, w_down_gfd, tile_expert_u, tile_used_u)


def _accumulate(acc_gxy: Array, part_bxy: Array, expert_b: Array, used_b: Array) -> Array:
    """acc[expert_b[i]] += part[i] for i in order, skipping unused tiles (no scatter-add)."""

    def add(i, acc):
        e = expert_b[i]
        new = lax.dynamic_index_in_dim(acc, e, keepdims=False) + part_bxy[i]
        new = jnp.where(used_b[i], new, lax.dynamic_index_in_dim(acc, e, keepdims=False))
        return lax.dynamic_update_index_in_dim(acc, new, e, 0)

    return lax.fori_loop(0, part_bxy.shape[0], add, acc_gxy)


def _zeros_varying_like(shape: tuple[int, ...], *arrays: Array) -> Array:
    """f32 zeros that vary over every mesh axis one of `arrays` varies over (inside shard_map,
    a loop carry must have its updates' type)."""
    axes = frozenset().union(*(varying_axes(a) for a in arrays))
    return vary(jnp.zeros(shape, jnp.float32), axes)


def _tiled_swiglu_bwd(dtype, residuals, dy_utd):
    x_utd, w_gate_gdf, w_up_gdf, w_down_gfd, tile_expert_u, tile_used_u = residuals

    def step(accs, args):
        x_btd, dy_btd, expert_b, used_b = args
        weights_b = (w[expert_b] for w in (w_gate_gdf, w_up_gdf, w_down_gfd))
        dx_btd, parts = _step_backward(x_btd, dy_btd, *weights_b, dtype)
        accs = tuple(
            _accumulate(acc, part, expert_b, used_b) for acc, part in zip(accs, parts, strict=True)
        )
        return accs, dx_btd

    zeros = tuple(
        _zeros_varying_like(w.shape, x_utd, dy_utd, w) for w in (w_gate_gdf, w_up_gdf, w_down_gfd)
    )
    xs = (_steps(x_utd), _steps(dy_utd), _steps(tile_expert_u), _steps(tile_used_u))
    (dw_gate, dw_up, dw_down), dx_sbtd = _scan_used_steps(step, zeros, xs, tile_used_u)
    dx_utd = dx_sbtd.reshape(x_utd.shape[0], x_utd.shape[1], -1).astype(x_utd.dtype)
    return (
        dx_utd,
        dw_gate.astype(w_gate_gdf.dtype),
        dw_up.astype(w_up_gdf.dtype),
        dw_down.astype(w_down_gfd.dtype),
        None,
        None,
    )


_tiled_swiglu.defvjp(_tiled_swiglu_fwd, _tiled_swiglu_bwd)
