"""Grouped matmuls on Hopper (sm90) with Pallas Mosaic GPU: forward, dgrad and fused SwiGLU.

  gmm         out[m] = lhs[m] @ rhs[g(m)]          [M, K] x [G, K, N] -> [M, N]
              (rhs[g(m)].T with transpose_rhs: rhs [G, N, K]; the input gradient of gmm)
              optionally each row times row_scale[m] (the routing weight), in f32
  gmm_swiglu  h[m] = silu(lhs[m] @ w_gate[g]) * (lhs[m] @ w_up[g])   -> [M, F]
  gmm_swiglu_bwd  the expert MLP's backward up to its last GEMMs: gate, up (from lhs) and
              g = dy @ w_down[g].T (from dy) in one pipeline, then h, [d_gate | d_up] and
              d_s = rowsum(h * g) from the epilogue        -> [M, F], [M, 2F], [M]

One persistent kernel per call: `grid_size` programs (one per streaming multiprocessor) walk a
list of output tiles. A program has one producer warpgroup and one or two consumer warpgroups
that share a ring of `max_concurrent_steps` shared-memory stages. The producer TMA-loads the
[block_m, block_k] lhs and [block_k, block_n] rhs tiles of every K step of every tile of its
program, in order, and runs ahead of the consumers by up to a full ring, across tile
boundaries: the next tile's first stages load while the consumers finish the current one and
run its epilogue. The consumers issue wgmma into f32 register accumulators, each owning
block_n // num_consumers columns of the tile or, with consumer_dim "m", block_m //
num_consumers of its rows; the epilogue (SwiGLU, row scale, cast) runs on
the accumulators and TMA-stores through shared memory. A tile's schedule (group, first row,
rows it stores) is one row of a [T, 4] table computed before the kernel; every warpgroup loads
the next tile's row while the current tile runs, so no scalar load stalls a tile's start.

Invariants (numbered; the tests check each):
  1. Row tiles start at their group's first row rounded down to a multiple of 8 (TMA into
     8-row-tiled shared memory addresses whole 8-row tiles): tile j of group g loads rows
     [base_g + j * block_m, base_g + (j + 1) * block_m), base_g = start_g - start_g % 8.
     Every row of a group runs through the same K steps (invariant 3) and wgmma computes each
     output row from its own lhs row only, so a row's bits do not depend on where its group
     starts in M. When every group starts on a multiple of 8 (groups padded to 8 rows, as the
     expert-parallel layer can lay them out) this is structural: the row sits at the same
     position of an identical tile. Otherwise the row's position in its tile shifts by
     start_g % 8 and the claim rests on wgmma treating every row alike, which
     test_gpu_row_bits_do_not_depend_on_where_the_group_starts checks on the hardware.
  2. Each output element has exactly one writer: a tile stores only its group's rows (a ladder
     of power-of-two TMA stores), columns are split between consumers, and rows past
     sum(group_sizes) are written once, with zeros, by the tiles of a pseudo-group G.
  3. Fixed reduction order: every output tile runs the K steps 0, 1, ..., K/block_k - 1 into
     one f32 accumulator. No split-K, no atomics.
  4. Rows the tile loads beyond its group (the next group's rows, or zeros past M that TMA
     fills in) are computed and never stored; they do not touch the group's rows.
  5. A stage is refilled only after every consumer released it, and a consumer releases a
     stage only after the wgmmas that read it completed: with delay_release=1 step s's stage
     is released at step s + 1 (after wgmma_wait(num_rhs): step s's own wgmmas may still run)
     and a tile's last stage after its final wgmma_wait(0); with delay_release=0 each stage
     right after wgmma_wait(0). The producer waits on a stage's `consumed` barrier before
     every reuse. The interpreter's race detector and barrier checks hold the protocol
     (test_no_races_between_warpgroups: arrivals, phases, the order of refills); it runs
     wgmma synchronously, so the wgmma side of the rule is held on the GPU
     (test_gpu_release_delay_does_not_change_bits: two stages, 64 K steps).
  6. The producer and the consumers walk the same tiles in the same order and count the same
     K steps (a carry of the tile loop), so step n always uses stage n % max_concurrent_steps
     and every barrier's phases are waited in order, each exactly once by each waiter. Tiles
     that run no K loop (rows of no group, unused schedule entries) load nothing.
  7. The CTAs of a cluster (2, or 4 with cluster_m = cluster_n = 2) walk the same work in the
     same order and run the same K steps into the same stages: along cluster_n they compute
     column tiles 2j and 2j + 1 of the same row tile and each stage's lhs tile is multicast
     into both; along cluster_m they compute the two block_m-row halves of the same
     [2 * block_m, block_n] tile of one group (the schedule tiles groups in 2 * block_m rows)
     and each stage's rhs tile is multicast into both. Whether a tile runs its K loop is
     decided for the whole cluster (a half with no rows of the group still loads and
     computes, and stores nothing), and a stage is refilled only after the consumers of every
     CTA that multicasts into it released it: itself and its partner along each cluster axis
     (a cluster barrier over the cluster's axes; in a 2 x 2 cluster it does not wait for the
     diagonal CTA, which writes nothing into this one: widen it before any multicast spans
     the whole cluster). The GPU interpreter does not model multicast (each CTA copies its
     own source into its own stages), so the interpret tests hold the arrivals, phases and
     tile mapping of clusters, and the GPU tests hold the cross-CTA side
     (test_gpu_clusters_give_the_single_cta_bits, test_gpu_release_delay_does_not_change_bits).
  8. Gathered rows (`lhs_rows_m`): row m of the product is lhs row lhs_rows_m[m], and the kernel
     runs exactly as on the materialized lhs[lhs_rows_m]: the same tiles, stages and K steps, the
     producer filling each stage's block_m rows with one 1-row TMA each (all on the stage's `loaded`
     barrier, block_m + num_rhs arrivals) where it would issue one block_m-row TMA; its 4 warps each
     issue a quarter of the rows (one issuer made the kernel 8.9x slower than on a copy of the rows
     at qwen3 size; four, 1.7x: per-row TMAs still cost). The rows land through a view of the stage
     with only the 128-byte swizzle (no 8-row tiling), which for 128-byte rows addresses the same
     bytes as the tiled view the wgmmas read. So the product is bitwise that of lhs[lhs_rows_m]
     (rows past M, which invariant 4 computes and never stores, read lhs row 0 here instead of TMA's
     zeros) (test_gathered_rows_give_the_bits_of_the_gathered_lhs; on the GPU, where the swizzle is
     real, test_gpu_gathered_rows_give_the_bits_of_the_gathered_lhs).
  9. An rhs given in parts along K (`gmm(lhs, (rhs_a, rhs_b), ...)`, the backward's
     [w_gate | w_up] without a concatenated copy) runs exactly as the concatenated rhs: the same
     tiles and K steps, step k's rhs tile TMA-loaded from the part holding K slice k (one copy
     a step, as for one rhs), so the bits are those of the concatenation
     (test_rhs_parts_give_the_bits_of_the_concatenated_rhs).
 10. gmm_swiglu_bwd runs every tile of gmm_swiglu's schedule with a second lhs (dy) beside lhs:
     a stage holds both lhs tiles and the w_gate, w_up and transposed w_down tiles (one
     barrier, 2 + 3 arrivals), and a K step issues three wgmmas (gate and up read lhs, g reads
     dy; each its own group for invariant 5) into three accumulators. The K steps of gate and
     up are gmm_swiglu's, and the epilogue computes h with its formula, so h is gmm_swiglu's
     bits (test_gmm_swiglu_bwd_matches_its_unfused_parts). The epilogue stores h, d_gate and
     d_up as invariant 2 stores outputs (d_up at column F + the tile's), and with a row scale
     each consumer's row sums of h * g over its columns, a 1-D TMA store of consumer_m f32 to
     its own slot [row tile, column owner, rows] of a partials array (column owner: the column
     tile, times 2 plus the consumer with consumer_dim "n"). Every slot of a tile that runs its
     K loop is written once; `_row_sums` then gathers, for each row, the slots of the one tile
     that stores the row (its group's, as invariant 2 picks it) and sums them in a fixed order
     (one reduction of a static shape), no atomics
     (test_gmm_swiglu_bwd_has_no_races_and_owns_each_partial_once).
 11. A kernel may run this body in programs [first_program, first_program + programs) only
     (`programs_body`: the exchange's dispatch runs its copies in the programs before
     them). The tiles are then dealt to those programs as they would be to a grid of that
     size (its program q gets the tiles q, q + programs, ...; the other programs none), and
     before a tile's first load the producer waits (`before_tile`) until the lhs rows the
     tile stores are in place. Rows a tile loads and does not store may still be arriving:
     invariant 4 computes them and never stores them. What a tile waits for must not wait for
     the tiles: the dispatch's copy programs wait for nothing, and they come first in the
     grid, so they are started before any GEMM program that waits for them.
 12. With `after_tile` (`programs_body`: the return's copies read the output while the tiles
     run), each consumer, after the epilogue of every tile that stores rows (hi > lo: a tile
     of a group or of the rows past them, even where this consumer's part of it stores none),
     waits until its stores have completed and then calls after_tile(mi), mi the tile's row
     tile: once the tile's num_tiles_n column tiles have each signalled from all
     num_consumers consumers, every row the row tile stores is in memory. Signals follow the
     stores; the tiles wait for nothing, so the programs that wait for them (the return's
     copy programs, first in the grid) cannot hold them up. Checked with the exchange's
     kernel (tests/pallas_kernels/exchange: `down_return`'s GPU twin, and the host test of
     the waits).
 13. With `before_scale` (`programs_body`: a row scale that other programs of the same kernel
     write, the exchange's forward in one kernel), each consumer waits for the scale of the
     rows a tile stores before it loads the tile's scale. The producer's waits (invariant 11)
     do not order the consumers' own loads of the scale, which are not the producer's TMA
     loads; rows the consumer loads and does not store may still be arriving (invariant 4).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import ring, tuning
from pallas_kernels.grouped_matmul.tuning import TileConfig

INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SWIZZLE_BYTES = 128
_ROW_ALIGN = 8  # a TMA load into 8-row-tiled shared memory starts at a multiple of 8 rows


# ----------------------------------------------------------------------------------------------
# The tile schedule (plain JAX, G-sized work before the kernel).


def group_bounds(group_sizes_g: Array, *, num_rows: int) -> tuple[Array, Array]:
    """int32 (starts_x, ends_x), each [G + 1]: the rows [start, end) of each group, clamped to
    the first num_rows rows, then of the pseudo-group G that holds the rows past every group."""
    ends_g = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_g.astype(jnp.int32), 0)), num_rows)
    ends_x = jnp.concatenate([ends_g, jnp.full((1,), num_rows, jnp.int32)])
    starts_x = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_x[:-1]])
    return starts_x, ends_x


def _group_tiles(
    group_sizes_g: Array, *, num_rows: int, block_m: int
) -> tuple[Array, Array, Array, Array]:
    """int32 (ends_x, base_x, tiles_x, first_tile_x), each [G + 1] (the groups, then the rows
    of none): a group's end row, its first row rounded down to a multiple of 8 (its tiles
    start there), its row tiles of block_m rows, and the index of its first tile."""
    starts_x, ends_x = group_bounds(group_sizes_g, num_rows=num_rows)
    base_x = starts_x - starts_x % _ROW_ALIGN
    tiles_x = jnp.where(ends_x > starts_x, (ends_x - base_x + block_m - 1) // block_m, 0)
    return ends_x, base_x, tiles_x, jnp.cumsum(tiles_x) - tiles_x


def tile_schedule(group_sizes_g: Array, *, num_rows: int, block_m: int) -> tuple[Array, Array]:
    """The row tiles of every group, in group order, then those of the rows of no group.

    Returns int32 (group_t, row0_t), each [cdiv(num_rows, block_m) + G]: tile t loads rows
    [row0_t, row0_t + block_m) and stores those of them in group group_t (G: the rows past every
    group, stored as zeros). A group's first tile starts at its first row rounded down to a
    multiple of 8 (TMA into 8-row-tiled shared memory needs that). Unused entries: group G,
    row0 = num_rows rounded up to a multiple of 8 (no rows to store).
    """
    num_groups = group_sizes_g.shape[0]
    num_tiles = pl.cdiv(num_rows, block_m) + num_groups
    _, base_x, tiles_x, first_tile_x = _group_tiles(
        group_sizes_g, num_rows=num_rows, block_m=block_m
    )
    tile_ends_x = first_tile_x + tiles_x
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    group_t = jnp.sum(t[:, None] >= tile_ends_x[None, :], axis=1, dtype=jnp.int32)
    in_use = group_t <= num_groups
    group_c = jnp.minimum(group_t, num_groups)
    row0_t = base_x[group_c] + (t - first_tile_x[group_c]) * block_m
    past_end = pl.cdiv(num_rows, _ROW_ALIGN) * _ROW_ALIGN
    row0_t = jnp.where(in_use, row0_t, past_end).astype(jnp.int32)
    return jnp.where(in_use, group_t, num_groups), row0_t


# ----------------------------------------------------------------------------------------------
# The kernel body's building blocks: shared-memory layouts, its refs by role, its scratch.


def _swizzled(itemsize: int) -> tuple[plgpu.TilingTransform, plgpu.SwizzleTransform]:
    elems = _SWIZZLE_BYTES // itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(_SWIZZLE_BYTES))


def _store_rows(src_smem, dst_gmem, lo, hi, *, granule: int = 1):
    """TMA-stores rows [lo, hi) of src_smem to the same rows of dst_gmem (0 <= lo, hi <= rows).

    TMA boxes are static, so hi - lo is written as a sum of powers of two, largest first, down
    to `granule` rows (lo and hi must then be multiples of it: a swizzled, 8-row-tiled buffer
    is sliced in whole 8-row tiles).
    """
    count = jnp.maximum(hi - lo, 0)
    offset = lo
    power = 1 << int(math.log2(src_smem.shape[0]))
    while power >= granule:
        part = count & power

        @pl.when(part != 0)
        def _store(offset=offset, power=power):
            start = offset if granule == 1 else pl.multiple_of(offset, granule)
            plgpu.copy_smem_to_gmem(
                src_smem.at[pl.ds(start, power)],
                dst_gmem.at[pl.ds(start, power)],
                commit_group=False,
            )

        offset = offset + part
        power //= 2


_GATHER_WARPS = 4  # the producer warpgroup's warps, each issuing a quarter of a stage's rows
# Gathered rows are issued per warp (plgpu.warp_map), whose scalar index loads lower only under
# Lane semantics in jax 0.11.2; the other kernels keep the Warpgroup semantics they were tuned
# under.
_GATHER_SEMANTICS = plgpu.LoweringSemantics.Lane
_PLAIN_SEMANTICS = plgpu.LoweringSemantics.Warpgroup
_GATHER_UNROLL = 1  # row copies per iteration of a warp's issue loop


def _cluster_axes(config: TileConfig) -> tuple[str, ...]:
    """The kernel's cluster axes: "cluster_m" and "cluster_n", those of size 2 (invariant 7)."""
    return tuple(axis for axis in ("cluster_m", "cluster_n") if getattr(config, axis) == 2)


@dataclasses.dataclass(frozen=True)
class _Refs:
    """A kernel body's refs by role, after the schedule and lhs (see `_split_refs`)."""

    dy: Any  # swiglu_bwd's second lhs (invariant 10), else None
    rows: Any  # gathered rows: row r of the product is lhs row rows[r] (invariant 8), else None
    rhs: tuple  # each rhs as rhs_k_parts refs, its consecutive parts along K (invariant 9)
    scale: Any  # f32 row scale, else None
    outs: tuple
    stored: tuple[tuple[Any, int], ...]  # (output, its first column) of each stored value
    ds: Any  # swiglu_bwd with a row scale: the d_s partials (invariant 10), else None


def _split_refs(
    refs,
    *,
    num_rhs: int,
    rhs_k_parts: int,
    has_row_scale: bool,
    gather_rows: bool,
    swiglu_bwd: bool,
    num_outs: int,
) -> _Refs:
    """The refs after the schedule and lhs: [dy], [rows], rhs parts, [scale], outputs. The
    outputs: one, then (SwiGLU with gate_up_out) the gate and up projections, rounded alike;
    swiglu_bwd: h [M, F], [d_gate | d_up] [M, 2F], then with a row scale the d_s partials."""
    dy_ref, refs = (refs[0], refs[1:]) if swiglu_bwd else (None, refs)
    rows_ref, refs = (refs[0], refs[1:]) if gather_rows else (None, refs)
    out_refs = tuple(refs[len(refs) - num_outs :])
    if swiglu_bwd:
        f = out_refs[0].shape[1]
        stored = ((out_refs[0], 0), (out_refs[1], 0), (out_refs[1], f))
    else:
        stored = tuple((ref, 0) for ref in out_refs)
    return _Refs(
        dy=dy_ref,
        rows=rows_ref,
        rhs=tuple(refs[: num_rhs * rhs_k_parts]),
        scale=refs[num_rhs * rhs_k_parts] if has_row_scale else None,
        outs=out_refs,
        stored=stored,
        ds=out_refs[2] if swiglu_bwd and has_row_scale else None,
    )


def _scratch(
    config: TileConfig,
    *,
    in_dtype,
    out_dtype,
    rhs_transposed: tuple[bool, ...],
    gather_rows: bool,
    swiglu_bwd: bool,
    interpret: bool,
) -> dict[str, Any]:
    """The shared memory and barriers of a kernel body: the ring's stages and its `loaded` and
    `consumed` barriers (invariants 5, 7), and the consumers' epilogue buffers."""
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    stages = config.max_concurrent_steps
    num_consumers = config.num_consumers
    epi_m, epi_n = config.epilogue_tile
    transforms = _swizzled(in_dtype.itemsize)
    out_swizzle = plgpu.find_swizzle(epi_n * out_dtype.itemsize * 8)
    out_transforms = (
        plgpu.TilingTransform((_ROW_ALIGN, out_swizzle // out_dtype.itemsize)),
        plgpu.SwizzleTransform(out_swizzle),
    )
    lhs_stages = plgpu.SMEM((stages, block_m, block_k), in_dtype, transforms=transforms)
    if gather_rows and not interpret:
        # Invariant 8: rows are TMA-loaded one by one through a view of the same bytes without
        # the 8-row tiling (one row of the tiled view is no TMA destination). 128-byte rows
        # (block_k * itemsize, checked) make the tiling the identity on the byte layout, and
        # the 128-byte swizzle follows the shared-memory address, so a row lands where an
        # 8-row copy would put it. (The GPU interpreter keeps a union's views apart; it takes
        # one-row slices of the tiled view instead.)
        lhs_stages = plgpu.RefUnion(
            lhs_stages,
            plgpu.SMEM(
                (stages, block_m, block_k),
                in_dtype,
                transforms=(plgpu.SwizzleTransform(_SWIZZLE_BYTES),),
            ),
        )
    return dict(
        lhs_smem=lhs_stages,
        dy_smem=(
            [plgpu.SMEM((stages, block_m, block_k), in_dtype, transforms=transforms)]
            if swiglu_bwd
            else []
        ),
        rhs_smems=[
            plgpu.SMEM(
                (stages, *((block_n, block_k) if transposed else (block_k, block_n))),
                in_dtype,
                transforms=transforms,
            )
            for transposed in rhs_transposed
        ],
        # swiglu_bwd: each consumer's d_s partial sums of a tile, staged for a 1-D TMA store.
        ds_smem=(
            [plgpu.SMEM((num_consumers, config.consumer_m), jnp.float32)] if swiglu_bwd else []
        ),
        # Epilogue buffers, two per consumer, seen two ways (never both at once): swizzled for
        # stores of whole 8-row tiles (bank-conflict free), plain for a sub-tile whose rows
        # start or end inside an 8-row tile (at group boundaries: rows are stored one by one).
        # One union per consumer, so that no consumer's view aliases another's buffers.
        epi_smem=[
            plgpu.RefUnion(
                plgpu.SMEM((2, epi_m, epi_n), out_dtype, transforms=out_transforms),
                plgpu.SMEM((2, epi_m, epi_n), out_dtype),
            )
            for _ in range(num_consumers)
        ],
        loaded=plgpu.Barrier(
            num_arrivals=(block_m if gather_rows else 1) + int(swiglu_bwd) + len(rhs_transposed),
            num_barriers=stages,
        ),
        # With clusters, a stage is refilled (by the CTAs' multicasts) only after the
        # consumers of this CTA and of its partner along each cluster axis released it.
        consumed=(
            plgpu.Barrier(num_arrivals=num_consumers, num_barriers=stages)
            if config.cluster_size == 1
            else plgpu.ClusterBarrier(
                collective_axes=_cluster_axes(config),
                num_arrivals=num_consumers,
                num_barriers=stages,
            )
        ),
    )


# ----------------------------------------------------------------------------------------------
# The producer's loads of one K step.


def _load_gathered_rows(lhs_ref, rows_ref, lhs_row_smem, loaded, *, slot, row0, ks, block_m):
    """Invariant 8: the stage's block_m lhs rows, one 1-row TMA each (rows_ref[row0 + r] into
    row r), each of the producer's warps issuing a quarter of them."""
    rows_per_warp = block_m // _GATHER_WARPS

    @plgpu.warp_map
    def _load_rows(warp):
        @pl.loop(0, rows_per_warp, unroll=_GATHER_UNROLL)
        def _load_row(i):
            r = warp * rows_per_warp + i
            plgpu.copy_gmem_to_smem(
                lhs_ref.at[pl.ds(rows_ref[row0 + r], 1), ks],
                lhs_row_smem.at[slot, pl.ds(r, 1)],
                loaded.at[slot],
            )


def _load_rhs_parts(
    parts, rhs_smem, loaded, *, slot, k, group, ns, transposed, part_steps, block_k, multicast
):
    """The rhs tile of K step k from the part that holds its K slice (invariant 9): one copy
    a step, as for one rhs."""
    for part, rhs_ref in enumerate(parts):

        def _load_rhs(part=part, rhs_ref=rhs_ref):
            local = pl.ds((k - part * part_steps) * block_k, block_k)
            src = rhs_ref.at[group, ns, local] if transposed else rhs_ref.at[group, local, ns]
            plgpu.copy_gmem_to_smem(
                src,
                rhs_smem.at[slot],
                loaded.at[slot],
                collective_axes="cluster_m" if multicast else None,
            )

        if len(parts) == 1:
            _load_rhs()
        else:
            in_part = k // part_steps == part
            pl.when(in_part)(_load_rhs)


# ----------------------------------------------------------------------------------------------
# The epilogues: each output tile's f32 accumulators to the values it stores, and the stores.


def _scale_rows(x, scale):
    """x [rows, cols] times scale [rows], row by row."""
    return x * lax.broadcast_in_dim(scale, x.shape, [0])


def _swiglu(gate, up):
    """silu(gate) * up, in f32 (the forward's formula: gmm_swiglu's bits)."""
    return gate / (1.0 + jnp.exp(-gate)) * up


def _forward_values(values, scale, *, swiglu: bool, num_outs: int) -> list:
    """The plain, row-scaled and SwiGLU epilogues: the product (SwiGLU of the gate and up
    products), times the row scale if any, then with gate_up_out the accumulators as they are."""
    if swiglu:
        gate, up = values
        out_f32 = _swiglu(gate, up)
    else:
        (out_f32,) = values
    if scale is not None:
        out_f32 = _scale_rows(out_f32, scale)
    return [out_f32, *values][:num_outs]


def _swiglu_bwd_values(values, scale):
    """Invariant 10: h with the forward epilogue's formula (its bits), dh = s * g, and SwiGLU's
    derivatives, all in f32: (h, d_gate, d_up) from the gate, up and g accumulators."""
    gate, up, g = values
    e = jnp.exp(-gate)
    h = gate / (1.0 + e) * up
    sig = 1.0 / (1.0 + e)
    dh = g
    if scale is not None:
        dh = _scale_rows(g, scale)
    d_gate = dh * up * (sig * (1.0 + gate * (1.0 - sig)))
    d_up = dh * (gate * sig)
    return h, d_gate, d_up


@dataclasses.dataclass(frozen=True)
class _Consumer:
    """One consumer warpgroup's part of every output tile: rows [row_off, row_off + m) and
    columns [col_off, col_off + n), stored through its own two epilogue buffers."""

    wg: Any
    row_off: Any
    col_off: Any
    m: int
    n: int
    epi_m: int
    epi_n: int
    epi_smem: list  # every consumer's (tiled, plain) buffer views, one union per consumer


def _store_sub_tile(part: _Consumer, slot, value, dst, first, end):
    """TMA-stores rows [first, end) of one [epi_m, epi_n] sub-tile through `slot` of this
    consumer's buffers."""
    whole_tiles = (first % _ROW_ALIGN == 0) & (end % _ROW_ALIGN == 0)
    for consumer, (tiled_smem, plain_smem) in enumerate(part.epi_smem):

        @pl.when((part.wg == consumer) & (end > first) & whole_tiles)
        def _store_whole_row_tiles(tiled_smem=tiled_smem):
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            tiled_smem[slot] = value
            plgpu.commit_smem()
            _store_rows(tiled_smem.at[slot], dst, first, end, granule=_ROW_ALIGN)
            plgpu.commit_smem_to_gmem_group()

        @pl.when((part.wg == consumer) & (end > first) & ~whole_tiles)
        def _store_rows_one_by_one(plain_smem=plain_smem):
            # The plain view aliases the tiled one: no store may still read either.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plain_smem[slot] = value
            plgpu.commit_smem()
            _store_rows(plain_smem.at[slot], dst, first, end)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _store_tile(part: _Consumer, outs_f32, stored, *, row0, lo, hi, ni, block_n, out_dtype):
    """Stores tile rows [lo, hi) of this consumer's [m, n] part of each output, in [epi_m,
    epi_n] sub-tiles through two shared-memory slots (invariant 2). outs_f32: a value per
    (output, first column) of `stored`."""
    epi_m, epi_n = part.epi_m, part.epi_n
    # The previous tile's stores must have read the buffers before they are reused.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    sub = 0
    for out_f32, (dst_ref, col_base) in zip(outs_f32, stored, strict=True):
        col0 = col_base + ni * block_n + part.col_off
        out_cast = out_f32.astype(out_dtype)
        for em in range(part.m // epi_m):
            for en in range(part.n // epi_n):
                rows = pl.ds(row0 + part.row_off + em * epi_m, epi_m)
                _store_sub_tile(
                    part,
                    sub % 2,
                    out_cast[em * epi_m : (em + 1) * epi_m, en * epi_n : (en + 1) * epi_n],
                    dst_ref.at[rows, pl.ds(col0 + en * epi_n, epi_n)],
                    jnp.clip(lo - part.row_off - em * epi_m, 0, epi_m),
                    jnp.clip(hi - part.row_off - em * epi_m, 0, epi_m),
                )
                sub += 1


def _store_row_sums(part: _Consumer, ds_smem, ds_ref, sums, *, mi, owner):
    """swiglu_bwd: this consumer's d_s partial sums of a tile of row tile mi, one f32 a row of
    its m rows, to ds_ref[mi, owner, rows] (owner: the column owner, invariant 10)."""
    # ds_smem is reused tile after tile: the previous tile's store of it has been read,
    # because `_store_tile` (which ran first in this tile) opened with wait_smem_to_gmem(0)
    # (the interpreter's stores finish at once: it cannot check this; the GPU twin can).
    ds_smem.at[part.wg][...] = sums
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(ds_smem.at[part.wg], ds_ref.at[mi, owner, pl.ds(part.row_off, part.m)])


def _load_scale(part: _Consumer, scale_ref, *, row0, lo, hi, before_scale):
    """This consumer's rows of a tile's row scale, f32 [m] in the accumulators' row layout;
    first, with before_scale (the exchange's hook), the wait for rows [row0 + lo, row0 + hi),
    which the tile stores (invariant 13)."""
    if before_scale is not None:
        before_scale(row0 + lo, row0 + hi)
    return plgpu.load(
        scale_ref.at[pl.ds(row0 + part.row_off, part.m)],
        layout=plgpu.Layout.WGMMA.reduce(1),
        optimized=False,
    )


def _signal_stored(after_tile, *, stores, mi) -> None:
    """Invariant 12 (the exchange's hook): once this consumer's stores of a tile of row tile mi
    that stores rows have landed, after_tile(mi)."""
    if after_tile is None:
        return

    @pl.when(stores)
    def _stored():
        plgpu.wait_smem_to_gmem(0)
        after_tile(mi)


# ----------------------------------------------------------------------------------------------
# The kernel body: the producer/consumer pipeline.


def _kernel(
    schedule_ref,
    lhs_ref,
    *refs,
    config: TileConfig,
    num_groups: int,
    num_tiles_m: int,
    transpose_rhs: bool,
    num_rhs: int,
    has_row_scale: bool,
    swiglu: bool,
    gather_rows: bool,
    interpret: bool,
    num_outs: int = 1,
    rhs_k_parts: int = 1,
    swiglu_bwd: bool = False,
    programs: int | None = None,
    first_program: int = 0,
    before_tile: Callable[[Array, Array, Array], None] | None = None,
    after_tile: Callable[[Array], None] | None = None,
    before_scale: Callable[[Array, Array], None] | None = None,
    set_registers: bool = True,
):
    # programs: the programs of the "sm" axis that run output tiles (None: all of them); a
    # kernel that gives its other programs other work calls this body from programs
    # [first_program, first_program + programs) only (invariant 11). before_tile(mi, first,
    # end): the producer's wait for lhs rows [first, end), which a tile of row tile mi stores,
    # before its first load. after_tile(mi): each consumer's signal that its stores of a tile
    # of row tile mi have completed (invariant 12). before_scale(first, end): each consumer's
    # wait, before it loads a tile's row scale, for the scale of rows [first, end), which the
    # tile stores (invariant 13). set_registers: the warpgroups set their register budgets
    # (False: a second body in the same kernel, whose first body set them).
    # swiglu_bwd (invariant 10): a second lhs (dy) and three rhs (w_gate, w_up with lhs, w_down
    # transposed with dy); the outputs h, [d_gate | d_up] and the d_s partial sums.
    rhs_lhs = (0, 0, 1) if swiglu_bwd else (0,) * num_rhs  # the lhs each rhs multiplies
    rhs_transposed = (False, False, True) if swiglu_bwd else (transpose_rhs,) * num_rhs
    r = _split_refs(
        refs,
        num_rhs=num_rhs,
        rhs_k_parts=rhs_k_parts,
        has_row_scale=has_row_scale,
        gather_rows=gather_rows,
        swiglu_bwd=swiglu_bwd,
        num_outs=num_outs,
    )
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    consumer_m, consumer_n = config.consumer_m, config.consumer_n
    split_m = config.consumer_dim == "m"
    num_consumers = config.num_consumers
    stages = config.max_concurrent_steps
    delay = config.delay_release
    k_steps = lhs_ref.shape[1] // block_k
    part_steps = k_steps // rhs_k_parts  # K steps of each rhs part (equal parts, checked)
    num_tiles_n = r.outs[0].shape[1] // block_n
    out_dtype = r.outs[0].dtype

    # With clusters (invariant 7), the grid walks pairs of tiles along each cluster axis.
    # cluster_n: CTA c computes column tile 2 * pair + c of a row tile, the lhs tile multicast.
    # cluster_m: the schedule's row tiles are 2 * block_m rows of one group and CTA c computes
    # their half c, the rhs tile multicast.
    pairs_n = num_tiles_n // config.cluster_n
    num_tiles = num_tiles_m * pairs_n
    multicast_lhs = config.cluster_n == 2
    multicast_rhs = config.cluster_m == 2
    num_lhs_rows = lhs_ref.shape[0]

    def tile_coords(lin):
        """(row tile, column tile) of output tile `lin` of the grid order (of this CTA)."""
        mi, nj = plgpu.planar_snake(
            lin,
            (num_tiles_m, pairs_n),
            0 if config.grid_minor_dim == "m" else 1,
            config.grid_tile_width,
        )
        if multicast_lhs:
            return mi, nj * config.cluster_n + lax.axis_index("cluster_n")
        return mi, nj

    def this_half(row0, lo, hi):
        """With cluster_m = 2: the schedule's [2 * block_m]-row tile's half of this CTA, as
        (first row, rows [lo, hi) of it to store). A half wholly past lhs's rows (the pair's
        second half at the end of M) loads lhs's last block_m rows instead, and stores none."""
        if not multicast_rhs:
            return row0, lo, hi
        offset = lax.axis_index("cluster_m") * block_m
        half_row0 = row0 + offset
        half_row0 = jnp.where(half_row0 >= num_lhs_rows, num_lhs_rows - block_m, half_row0)
        return (
            half_row0,
            jnp.clip(lo - offset, 0, block_m),
            jnp.clip(hi - offset, 0, block_m),
        )

    def fetch(lin):
        """The schedule of output tile `lin`: group, first row, and [lo, hi) the rows of the
        tile it stores (with cluster_m, the rows of the pair's 2 * block_m-row tile; scalar
        GMEM loads, made one tile ahead by the tile loop)."""
        mi, _ = tile_coords(lin)
        return tuple(schedule_ref[mi, j] for j in range(4))

    def tile_loop(body):
        """Runs body(mi, ni, group, row0, lo, hi, runs, step0) -> step count after the tile, for
        this program's output tiles in grid order, each tile's schedule loaded while the
        previous tile runs; returns the program's step count (invariant 6). `runs`: the tile
        runs its K loop (in every CTA of a cluster alike, invariant 7); [lo, hi): the rows of
        this CTA's tile it stores."""

        @ring.prefetching_loop(
            num_tiles, fetch, axis="sm", programs=programs, first_program=first_program
        )
        def steps(lin, step0, values):
            mi, ni = tile_coords(lin)
            group, row0, lo, hi = values
            runs = (hi > lo) & (group < num_groups)
            row0, lo, hi = this_half(row0, lo, hi)
            return body(mi, ni, group, pl.multiple_of(row0, _ROW_ALIGN), lo, hi, runs, step0)

        return steps

    @functools.partial(
        pl.run_scoped,
        **_scratch(
            config,
            in_dtype=lhs_ref.dtype,
            out_dtype=out_dtype,
            rhs_transposed=rhs_transposed,
            gather_rows=gather_rows,
            swiglu_bwd=swiglu_bwd,
            interpret=interpret,
        ),
        collective_axes="wg",
    )
    def _scope(lhs_smem, dy_smem, rhs_smems, ds_smem, epi_smem, loaded, consumed):
        wg = lax.axis_index("wg")
        if gather_rows:
            lhs_smem, lhs_row_smem = lhs_smem if not interpret else (lhs_smem, lhs_smem)
        # After the union's split above (its tiled view is what the wgmmas read).
        lhs_smems = [lhs_smem, *dy_smem]  # lhs_smems[rhs_lhs[i]]: the lhs stages of rhs i

        # 1. The producer: every K step of every matmul tile of this program, in order, into
        #    the ring of stages (invariants 5, 6). It runs ahead of the consumers by up to
        #    `stages` steps, across tile boundaries.
        @pl.when(wg == num_consumers)
        def _producer():
            if set_registers:
                plgpu.set_max_registers(ring.PRODUCER_REGISTERS, action="decrease")

            @tile_loop
            def num_steps(mi, ni, group, row0, lo, hi, runs, step0):
                @pl.when(runs)
                def _load_tile():
                    if before_tile is not None:
                        before_tile(mi, row0 + lo, row0 + hi)  # invariant 11

                    @pl.loop(0, k_steps)
                    def _load_step(k):
                        slot = ring.acquire_stage(consumed, step=step0 + k, stages=stages)
                        ks = pl.ds(k * block_k, block_k)
                        if gather_rows:
                            _load_gathered_rows(
                                lhs_ref,
                                r.rows,
                                lhs_row_smem,
                                loaded,
                                slot=slot,
                                row0=row0,
                                ks=ks,
                                block_m=block_m,
                            )
                        else:
                            plgpu.copy_gmem_to_smem(
                                lhs_ref.at[pl.ds(row0, block_m), ks],
                                lhs_smem.at[slot],
                                loaded.at[slot],
                                collective_axes="cluster_n" if multicast_lhs else None,
                            )
                        if swiglu_bwd:
                            plgpu.copy_gmem_to_smem(
                                r.dy.at[pl.ds(row0, block_m), ks],
                                dy_smem[0].at[slot],
                                loaded.at[slot],
                            )
                        ns = pl.ds(ni * block_n, block_n)
                        for index, rhs_smem in enumerate(rhs_smems):
                            _load_rhs_parts(
                                r.rhs[index * rhs_k_parts : (index + 1) * rhs_k_parts],
                                rhs_smem,
                                loaded,
                                slot=slot,
                                k=k,
                                group=group,
                                ns=ns,
                                transposed=rhs_transposed[index],
                                part_steps=part_steps,
                                block_k=block_k,
                                multicast=multicast_rhs,
                            )

                return step0 + jnp.where(runs, k_steps, 0)

            ring.observe_last_releases(consumed, num_steps, stages)

        # 2. The consumers: wgmma over the K steps into f32 accumulators (invariant 3), each
        #    warpgroup its own rows (consumer_dim "m") or columns ("n"), then the epilogue.
        @pl.when(wg < num_consumers)
        def _consumers():
            if set_registers:
                plgpu.set_max_registers(ring.consumer_registers(num_consumers), action="increase")
            part = _Consumer(
                wg=wg,
                row_off=pl.multiple_of(wg * consumer_m, 64) if split_m else 0,
                col_off=0 if split_m else wg * consumer_n,
                m=consumer_m,
                n=consumer_n,
                epi_m=config.epilogue_tile[0],
                epi_n=config.epilogue_tile[1],
                epi_smem=epi_smem,
            )
            store_tile = functools.partial(_store_tile, part, block_n=block_n, out_dtype=out_dtype)

            def epilogue(values, scale, *, mi, ni, row0, lo, hi):
                """A tile's epilogue on its f32 accumulator values: gmm_swiglu_bwd's (h,
                [d_gate | d_up], the d_s partials) or the forward's (plain, row-scaled, SwiGLU)."""
                if swiglu_bwd:
                    h, d_gate, d_up = _swiglu_bwd_values(values, scale)
                    store_tile([h, d_gate, d_up], r.stored, row0=row0, lo=lo, hi=hi, ni=ni)
                    if has_row_scale:
                        # d_s = rowsum(h * g) over F: this tile's columns, from h rounded as
                        # stored.
                        h_stored = h.astype(out_dtype).astype(jnp.float32)
                        _store_row_sums(
                            part,
                            ds_smem[0],
                            r.ds,
                            jnp.sum(h_stored * values[2], axis=1),
                            mi=mi,
                            owner=ni if split_m else ni * num_consumers + wg,
                        )
                    return
                outs_f32 = _forward_values(values, scale, swiglu=swiglu, num_outs=num_outs)
                store_tile(outs_f32, r.stored, row0=row0, lo=lo, hi=hi, ni=ni)

            @tile_loop
            def _tiles(mi, ni, group, row0, lo, hi, runs, step0):
                stores = hi > lo

                # (a) A tile of a group: the K loop, then the epilogue (invariants 1, 3, 4, 5).
                @pl.when(runs)
                def _matmul_tile():
                    def k_step(k, accs):
                        """K step k: its wgmmas into `accs`, then the release of a stage."""
                        step = step0 + k
                        slot = lax.rem(step, stages)
                        plgpu.barrier_wait(loaded.at[slot])
                        lhs_tiles = [smem.at[slot] for smem in lhs_smems]
                        if split_m:
                            lhs_tiles = [t.at[pl.ds(part.row_off, consumer_m)] for t in lhs_tiles]
                        for i, (acc, rhs_smem) in enumerate(zip(accs, rhs_smems, strict=True)):
                            lhs_tile = lhs_tiles[rhs_lhs[i]]
                            rhs_tile = rhs_smem.at[slot]
                            if rhs_transposed[i]:
                                if not split_m:
                                    rhs_tile = rhs_tile.at[pl.ds(part.col_off, consumer_n), :]
                                rhs_tile = rhs_tile.transpose((1, 0))
                            elif not split_m:
                                rhs_tile = rhs_tile.at[:, pl.ds(part.col_off, consumer_n)]
                            plgpu.wgmma(acc, lhs_tile, rhs_tile)
                        # Invariant 5: a stage is released once the wgmmas reading it are done
                        # (each wgmma is its own group: num_rhs groups a step).
                        ring.release_after_wgmma(
                            consumed,
                            step=step,
                            first_of_item=k == 0,
                            delay=delay,
                            groups_per_step=num_rhs,
                            stages=stages,
                        )
                        return accs

                    def acc_scope(*accs):
                        scale = None
                        if has_row_scale:
                            # Loaded before the K loop, so its latency hides behind it.
                            scale = _load_scale(
                                part, r.scale, row0=row0, lo=lo, hi=hi, before_scale=before_scale
                            )
                        accs = lax.fori_loop(0, k_steps, k_step, accs)
                        last_step = step0 + k_steps - 1
                        ring.release_last(consumed, last_step=last_step, delay=delay, stages=stages)
                        values = [acc[...] for acc in accs]
                        epilogue(values, scale, mi=mi, ni=ni, row0=row0, lo=lo, hi=hi)

                    pl.run_scoped(
                        acc_scope,
                        *[plgpu.ACC((consumer_m, consumer_n), jnp.float32) for _ in range(num_rhs)],
                    )

                # (b) Rows of no group: the consumers store zeros (invariant 2).
                @pl.when(stores & (group == num_groups))
                def _zero_tile():
                    zeros = plgpu.layout_cast(
                        jnp.zeros((consumer_m, consumer_n), jnp.float32), plgpu.Layout.WGMMA
                    )
                    store_tile([zeros] * len(r.stored), r.stored, row0=row0, lo=lo, hi=hi, ni=ni)

                _signal_stored(after_tile, stores=stores, mi=mi)
                return step0 + jnp.where(runs, k_steps, 0)

            plgpu.wait_smem_to_gmem(0)


# ----------------------------------------------------------------------------------------------
# Public wrappers.


def check_inputs(
    lhs_mk: Array, rhs: tuple[Array, ...], group_sizes_g: Array, names: tuple[str, ...]
) -> None:
    """Raises ValueError unless the grouped GEMM's inputs are what its kernels read: lhs [M, K]
    in bfloat16 or float16; each rhs part (named in the messages by `names`, one a part) of
    rank 3 [G, ., .], of lhs's dtype and of the first part's shape; group_sizes int32 [G]."""
    if lhs_mk.ndim != 2:
        raise ValueError(f"lhs must be [M, K], got shape {lhs_mk.shape}")
    if jnp.dtype(lhs_mk.dtype) not in INPUT_DTYPES:
        raise ValueError(f"lhs dtype {lhs_mk.dtype} must be bfloat16 or float16")
    for name, r in zip(names, rhs, strict=True):
        if r.ndim != 3:
            raise ValueError(f"{name} must be rank 3 [G, ., .], got shape {r.shape}")
        if r.dtype != lhs_mk.dtype:
            raise ValueError(f"{name} dtype {r.dtype} must equal lhs dtype {lhs_mk.dtype}")
        if r.shape != rhs[0].shape:
            raise ValueError(f"{name} shape {r.shape} must equal {names[0]} shape {rhs[0].shape}")
    if group_sizes_g.ndim != 1 or group_sizes_g.shape[0] != rhs[0].shape[0]:
        raise ValueError(
            f"group_sizes shape {group_sizes_g.shape} must be [G] with G={rhs[0].shape[0]}"
        )
    if group_sizes_g.dtype != jnp.int32:
        raise ValueError(f"group_sizes dtype {group_sizes_g.dtype} must be int32")


def _default_config(
    shape_class: tuning.ShapeClass,
    *,
    n: int,
    itemsize: int,
    out_itemsize: int,
    num_rhs: int,
    interpret: bool,
    num_lhs: int = 1,
    dim: str = "N",
) -> TileConfig:
    """The table's tiles, with block_n narrowed (256 -> 128 -> 64 on one consumer) until it
    divides N, and stages dropped until they fit shared memory. Only defaults are narrowed: a
    caller's config is validated, never replaced."""
    config = tuning.default_config(shape_class, interpret=interpret)
    if n % 64:
        raise ValueError(f"{dim}={n} must be a multiple of 64")
    while n % config.block_n:
        block_n = config.block_n // 2 if config.block_n > 128 else 64
        if config.consumer_dim == "m":  # the consumers split rows: any block_n suits them
            consumers = config.num_consumers
            epi_n = min(config.epilogue_tile[1], block_n)
        else:
            consumers = config.num_consumers if block_n >= 128 else 1
            epi_n = min(config.epilogue_tile[1], block_n // consumers)
        config = dataclasses.replace(
            config, block_n=block_n, num_consumers=consumers, epi_block_n=epi_n
        )
    if (n // config.block_n) % config.cluster_n:
        config = dataclasses.replace(config, cluster_n=1)
    limit = tuning.DEVICES[tuning.resolve_device_kind()].smem_bytes
    while (
        config.smem_bytes(
            itemsize=itemsize, out_itemsize=out_itemsize, num_rhs=num_rhs, num_lhs=num_lhs
        )
        > limit
        and config.max_concurrent_steps > config.delay_release + 1
    ):
        config = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps - 1)
    return config


def default_config(
    *,
    n: int,
    dtype=jnp.bfloat16,
    transpose_rhs: bool = False,
    out_dtype=None,
    swiglu: bool = False,
    interpret: bool = False,
) -> TileConfig:
    """The tiles `gmm` (or `gmm_swiglu` if `swiglu`) runs with config=None: the table's, for an
    output of N columns (F for gmm_swiglu), `dtype` inputs and `out_dtype` outputs (None: the
    input dtype), narrowed as the kernel needs (see `_default_config`)."""
    itemsize = jnp.dtype(dtype).itemsize
    out_itemsize = jnp.dtype(dtype if out_dtype is None else out_dtype).itemsize
    if swiglu:
        shape_class: tuning.ShapeClass = "gmm_swiglu"
    else:
        shape_class = tuning.gmm_shape_class(
            transpose_rhs=transpose_rhs, out_dtype=dtype if out_dtype is None else out_dtype
        )
    return _default_config(
        shape_class,
        n=n,
        itemsize=itemsize,
        out_itemsize=out_itemsize,
        num_rhs=2 if swiglu else 1,
        interpret=interpret,
    )


def check_config(
    config: TileConfig,
    *,
    k: int,
    n: int,
    itemsize: int,
    out_itemsize: int,
    num_rhs: int,
    num_lhs: int = 1,
    dim: str = "N",
) -> None:
    """Raises ValueError if the kernel cannot run `config`'s tiles for K = k and an output of n
    columns (named `dim` in the messages: N, or F for gmm_swiglu_bwd): K and N must be whole
    blocks, the column tiles whole clusters, an epilogue row a multiple of 128 bytes, and the
    stages of `num_lhs` lhs and `num_rhs` rhs tiles (inputs of `itemsize` bytes, outputs of
    `out_itemsize`) must fit the device's shared memory."""
    if k % config.block_k:
        raise ValueError(f"K={k} must be a multiple of block_k={config.block_k}")
    if n % config.block_n:
        raise ValueError(f"{dim}={n} must be a multiple of block_n={config.block_n}")
    if (n // config.block_n) % config.cluster_n:
        raise ValueError(
            f"cluster_n={config.cluster_n} needs an even number of column tiles, got "
            f"N={n} / block_n={config.block_n} = {n // config.block_n}"
        )
    epi_row_bytes = config.epilogue_tile[1] * out_itemsize
    if epi_row_bytes % 128:
        # A group boundary's rows are TMA-stored one by one from shared memory, whose
        # addresses TMA needs 128-byte aligned: an epilogue row must be a multiple of that.
        raise ValueError(
            f"epi_block_n={config.epilogue_tile[1]} x {out_itemsize}-byte outputs = "
            f"{epi_row_bytes} bytes a row: it must be a multiple of 128"
        )
    smem = config.smem_bytes(
        itemsize=itemsize, out_itemsize=out_itemsize, num_rhs=num_rhs, num_lhs=num_lhs
    )
    limit = tuning.DEVICES[tuning.resolve_device_kind()].smem_bytes
    if smem > limit:
        raise ValueError(
            f"{config} needs {smem} bytes of shared memory, more than the {limit} available: "
            "use fewer stages (max_concurrent_steps) or smaller blocks"
        )


def _without_clusters(config: TileConfig, lhs_rows_m: Array | None) -> TileConfig:
    """A default config for gathered rows, which run without clusters (the table's may not)."""
    if lhs_rows_m is None:
        return config
    return dataclasses.replace(config, cluster_m=1, cluster_n=1)


def _num_rows(lhs_mk: Array, lhs_rows_m: Array | None) -> int:
    """M, the product's rows: lhs's, or with gathered rows the row table's (validated)."""
    if lhs_rows_m is None:
        return lhs_mk.shape[0]
    if lhs_rows_m.ndim != 1 or lhs_rows_m.dtype != jnp.int32:
        raise ValueError(f"lhs_rows_m must be int32 [M], got {lhs_rows_m.dtype} {lhs_rows_m.shape}")
    return lhs_rows_m.shape[0]


def _check_rows(lhs_mk: Array, lhs_rows_m: Array | None, config: TileConfig) -> None:
    """Validates gathered rows (`lhs_rows_m`) against lhs and the tiles."""
    if lhs_rows_m is None:
        return
    if lhs_rows_m.shape[0] and lhs_mk.shape[0] == 0:
        raise ValueError(f"lhs has no rows to gather {lhs_rows_m.shape[0]} rows from")
    if config.block_k * lhs_mk.dtype.itemsize != _SWIZZLE_BYTES:
        raise ValueError(
            f"gathered rows need block_k * itemsize = {_SWIZZLE_BYTES} bytes (one swizzled "
            f"row a TMA), got block_k={config.block_k} for {lhs_mk.dtype}"
        )
    if config.cluster_size != 1:
        raise ValueError(f"gathered rows run without clusters, got {config}")


def _interpret_params(interpret: bool | plgpu.InterpretGPUParams):
    """None (compile for the GPU), or the GPU interpreter's parameters (e.g. detect_races)."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def schedule_table(group_sizes_g: Array, *, num_rows: int, tile_m: int) -> Array:
    """int32 [T, 4]: per row tile of `tile_schedule`, its group, first row and the rows
    [lo, hi) of it that it stores; one table, so that a tile needs four independent scalar
    loads (no dependent ones)."""
    group_t, row0_t = tile_schedule(group_sizes_g, num_rows=num_rows, block_m=tile_m)
    starts_x, ends_x = group_bounds(group_sizes_g, num_rows=num_rows)
    lo_t = jnp.clip(starts_x[group_t] - row0_t, 0, tile_m)
    hi_t = jnp.clip(ends_x[group_t] - row0_t, 0, tile_m)
    return jnp.stack([group_t, row0_t, lo_t, hi_t], axis=1).astype(jnp.int32)


# The GEMMs a kernel of other work runs in some of its programs (invariant 11; the exchange's
# kernels, pallas_kernels/exchange): the body's flags for each.
ProgramsGemm = Literal["swiglu", "scaled", "transposed", "dgrad"]
_PROGRAMS_GEMMS: dict[str, dict[str, bool | int]] = {
    # h = silu(lhs @ w_gate[g]) * (lhs @ w_up[g]), lhs dtype: refs w_gate, w_up, h.
    "swiglu": dict(transpose_rhs=False, num_rhs=2, has_row_scale=False, swiglu=True),
    # (lhs @ rhs[g]) * scale, f32: refs rhs, scale (f32 [M' + block_m]), out.
    "scaled": dict(transpose_rhs=False, num_rhs=1, has_row_scale=True, swiglu=False),
    # lhs @ rhs[g].T, f32: refs rhs [G, N, K], out.
    "transposed": dict(transpose_rhs=True, num_rhs=1, has_row_scale=False, swiglu=False),
    # lhs @ [rhs_a | rhs_b][g].T in lhs dtype, the rhs in two parts along K (invariant 9):
    # refs rhs_a, rhs_b [G, N, K/2], out. The expert MLP's input gradient from [d_gate | d_up].
    "dgrad": dict(transpose_rhs=True, num_rhs=1, has_row_scale=False, swiglu=False, rhs_k_parts=2),
}


def _check_programs_gemm(gemm: str) -> None:
    if gemm not in _PROGRAMS_GEMMS:
        raise ValueError(f"gemm={gemm!r} must be one of {tuple(_PROGRAMS_GEMMS)}")


def programs_config(gemm: ProgramsGemm, *, n: int, dtype) -> TileConfig:
    """The tiles `programs_body` runs for `gemm` with N = n (F for "swiglu"): the default of
    `gmm_swiglu` ("swiglu"), of `gmm` with an f32 output ("scaled", "transposed") or of the
    transposed `gmm` with the lhs dtype's ("dgrad"), without
    clusters (a kernel whose programs do different work cannot pair them). Clusters give the
    single-CTA bits (invariant 7), so the outputs are those of `gmm_swiglu` and `gmm`, bit for
    bit."""
    _check_programs_gemm(gemm)
    if gemm == "swiglu":
        config = default_config(n=n, dtype=dtype, swiglu=True)
    elif gemm == "dgrad":
        config = default_config(n=n, dtype=dtype, transpose_rhs=True)
    else:
        transposed = _PROGRAMS_GEMMS[gemm]["transpose_rhs"]
        config = default_config(n=n, dtype=dtype, transpose_rhs=transposed, out_dtype=jnp.float32)
    return dataclasses.replace(config, cluster_m=1, cluster_n=1)


def programs_body(
    gemm: ProgramsGemm,
    schedule_ref,
    lhs_ref,
    *refs,
    config: TileConfig,
    programs: int,
    first_program: int,
    before_tile: Callable[[Array, Array, Array], None] | None = None,
    after_tile: Callable[[Array], None] | None = None,
    before_scale: Callable[[Array, Array], None] | None = None,
    set_registers: bool = True,
) -> None:
    """A grouped GEMM's kernel body in programs [first_program, first_program + programs) of a
    kernel of more programs (its grid axis named "sm", warpgroups "wg", num_consumers + 1 of
    them, Warpgroup semantics), whose other programs do other work: the exchange's copies
    (pallas_kernels/exchange). Call it in those programs only (invariant 11).

    gemm: "swiglu" (refs w_gate, w_up [G, K, F], h [M', F]: `gmm_swiglu`), "scaled" (refs rhs
    [G, K, N], scale f32 [M' + block_m], out f32 [M', N]: `gmm(..., row_scale_m=scale,
    out_dtype=f32)`), "transposed" (refs rhs [G, N, K], out f32 [M', N]: `gmm(...,
    transpose_rhs=True, out_dtype=f32)`) or "dgrad" (refs rhs_a, rhs_b [G, N, K/2], out [M',
    N] in lhs dtype: `gmm(lhs, (rhs_a, rhs_b), ..., transpose_rhs=True)`), with
    `programs_config(gemm, ...)`'s tiles. lhs [M',
    K] (M' >= max(M, block_m), a multiple of 8); schedule_ref [T, 4] is
    `schedule_table(group_sizes, num_rows=M, tile_m=config.block_m)`; outputs as those
    functions compute them, rows past M unspecified.

    `before_tile(mi, first, end)` runs in the producer before a tile's first load and returns
    once lhs rows [first, end), the rows the tile (of row tile mi) stores, are in place
    (invariant 11). Each consumer calls `after_tile(mi)` once its stores of a tile of row tile
    mi have completed (invariant 12): N / block_n * num_consumers calls a row tile that stores
    rows. With a row scale, each consumer calls `before_scale(first, end)` before it loads
    the scale of a tile that stores rows [first, end) (invariant 13). A kernel that runs two
    bodies one after the other in the same programs (pallas_kernels/exchange's forward)
    passes set_registers=False to the second: the first set the warpgroups' registers."""
    _check_programs_gemm(gemm)
    _kernel(
        schedule_ref,
        lhs_ref,
        *refs,
        config=config,
        num_groups=refs[0].shape[0],
        num_tiles_m=schedule_ref.shape[0],
        gather_rows=False,
        interpret=False,
        programs=programs,
        first_program=first_program,
        before_tile=before_tile,
        after_tile=after_tile,
        before_scale=before_scale,
        set_registers=set_registers,
        **_PROGRAMS_GEMMS[gemm],
    )


def _grouped_call(
    lhs_mk: Array,
    rhs: tuple[Array, ...],
    group_sizes_g: Array,
    *,
    transpose_rhs: bool,
    row_scale_m: Array | None,
    lhs_rows_m: Array | None,
    out_dtype,
    config: TileConfig,
    swiglu: bool,
    interpret: bool | plgpu.InterpretGPUParams,
    num_outs: int = 1,
    rhs_k_parts: int = 1,
    dy_mk: Array | None = None,
) -> Array | tuple[Array, ...]:
    """The kernel call. With dy_mk (swiglu_bwd: rhs = w_gate, w_up, w_down), returns h, [d_gate
    | d_up] and, with a row scale, the d_s partials [T, P, block_m] (see `_row_sums`)."""
    gather_rows = lhs_rows_m is not None
    swiglu_bwd = dy_mk is not None
    num_rows = _num_rows(lhs_mk, lhs_rows_m)
    num_groups = rhs[0].shape[0]
    n = rhs[0].shape[1] if transpose_rhs else rhs[0].shape[2]
    if num_rows == 0 or num_groups == 0 or lhs_mk.shape[1] == 0:
        zeros = jnp.zeros((num_rows, n), out_dtype)
        if swiglu_bwd:
            grads = jnp.zeros((num_rows, 2 * n), out_dtype)
            return (zeros, grads) + ((jnp.zeros((0, 1, 1), jnp.float32),) if num_outs == 3 else ())
        return zeros if num_outs == 1 else (zeros,) * num_outs
    block_m = config.block_m
    # With cluster_m = 2 a scheduled row tile is a pair of CTAs' tiles (invariant 7).
    tile_m = block_m * config.cluster_m
    # A TMA box may not be taller than its tensor: tiny inputs are padded to one tile (lhs and
    # out). TMA between GMEM and 8-row-tiled shared memory views a tensor in whole 8-row tiles:
    # lhs and out have a multiple of 8 rows (lhs padded, a copy avoided when M is a multiple of
    # 8; out's extra rows are sliced off). Gathered rows are loaded one by one: lhs stays as
    # it is, and the row table is padded (with row 0) for the last tile's reads.
    out_rows = pl.cdiv(max(num_rows, block_m), _ROW_ALIGN) * _ROW_ALIGN
    if gather_rows:
        rows = jnp.clip(lhs_rows_m.astype(jnp.int32), 0, lhs_mk.shape[0] - 1)
        gathered = [jnp.pad(rows, (0, out_rows - num_rows + tile_m))]
    else:
        gathered = []
        if out_rows != num_rows:
            lhs_mk = jnp.pad(lhs_mk, ((0, out_rows - num_rows), (0, 0)))
    if swiglu_bwd:
        gathered = [jnp.pad(dy_mk, ((0, out_rows - num_rows), (0, 0)))]
    schedule_t4 = schedule_table(group_sizes_g, num_rows=num_rows, tile_m=tile_m)
    operands = [schedule_t4, lhs_mk, *gathered, *rhs]
    if row_scale_m is not None:
        # Scales are read for whole tiles (with cluster_m, a pair's): pad so that the last
        # tile's read stays in bounds.
        operands.append(jnp.pad(row_scale_m, (0, out_rows - num_rows + tile_m)))
    grid_size = config.grid_size or tuning.persistent_grid_size(cluster_size=config.cluster_size)
    cluster_axes = _cluster_axes(config)
    body = functools.partial(
        _kernel,
        config=config,
        num_groups=num_groups,
        num_tiles_m=schedule_t4.shape[0],
        transpose_rhs=transpose_rhs,
        num_rhs=len(rhs) // rhs_k_parts,
        has_row_scale=row_scale_m is not None,
        swiglu=swiglu,
        gather_rows=gather_rows,
        interpret=_interpret_params(interpret) is not None,
        num_outs=num_outs,
        rhs_k_parts=rhs_k_parts,
        swiglu_bwd=swiglu_bwd,
    )
    out_type = jax.ShapeDtypeStruct((out_rows, n), out_dtype)
    if swiglu_bwd:
        # h, [d_gate | d_up], then the d_s partials: per row tile, per column owner (a column
        # tile, or each consumer's half of one), per row of the tile (invariant 10).
        owners = (n // config.block_n) * (1 if config.consumer_dim == "m" else config.num_consumers)
        out_types = (out_type, jax.ShapeDtypeStruct((out_rows, 2 * n), out_dtype)) + (
            (jax.ShapeDtypeStruct((schedule_t4.shape[0], owners, block_m), jnp.float32),)
            if num_outs == 3
            else ()
        )
    else:
        out_types = out_type if num_outs == 1 else (out_type,) * num_outs
    outs = plgpu.kernel(
        body,
        out_type=out_types,
        grid=(max(1, grid_size // config.cluster_size),),
        grid_names=("sm",),
        **(
            {"cluster": (2,) * len(cluster_axes), "cluster_names": cluster_axes}
            if cluster_axes
            else {}
        ),
        num_threads=config.num_consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=_GATHER_SEMANTICS if gather_rows else _PLAIN_SEMANTICS
        ),
        interpret=_interpret_params(interpret),
    )(*operands)
    if num_outs == 1:
        return outs[:num_rows] if out_rows != num_rows else outs
    if swiglu_bwd:
        return tuple(out[:num_rows] for out in outs[:2]) + tuple(outs[2:])
    return tuple(out[:num_rows] if out_rows != num_rows else out for out in outs)


def gmm(
    lhs_mk: Array,
    rhs_gkn: Array | tuple[Array, ...],
    group_sizes_g: Array,
    *,
    transpose_rhs: bool = False,
    row_scale_m: Array | None = None,
    lhs_rows_m: Array | None = None,
    out_dtype=None,
    config: TileConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> Array:
    """[M, N]: each row of lhs [M, K] times its group's rhs [G, K, N] (rhs [G, N, K] transposed
    if `transpose_rhs`), optionally times `row_scale_m` (f32 [M]) in f32; rows past
    sum(group_sizes_g) are 0. bf16/f16 inputs, f32 accumulation, out_dtype lhs's or f32.

    With `lhs_rows_m` (int32 [M]) lhs is [T, K] and row m of the product is lhs row
    lhs_rows_m[m], clipped to [0, T) (a negative index reads row 0, not from the end), read
    straight from lhs one row at a time (invariant 8): for indices in [0, T),
    `gmm(x, w, sizes, lhs_rows_m=idx)` equals `gmm(x[idx], w, sizes)` bit for bit, without
    materializing x[idx]. Needs block_k * itemsize = 128 and no clusters.

    rhs_gkn may be a tuple of P arrays of one shape: the rhs is then their concatenation along
    K (axis 1, or axis 2 with transpose_rhs), read part by part in the kernel (invariant 9), so
    `gmm(dy, (w_a, w_b), sizes, transpose_rhs=True)` equals
    `gmm(dy, jnp.concatenate([w_a, w_b], 2), sizes, transpose_rhs=True)` bit for bit without
    the concatenated copy. Each part's K must be a multiple of block_k."""
    parts = tuple(rhs_gkn) if isinstance(rhs_gkn, (tuple, list)) else (rhs_gkn,)
    if not parts:
        raise ValueError("rhs_gkn must be an array or a non-empty tuple of arrays")
    names = ("rhs",) if len(parts) == 1 else tuple(f"rhs[{i}]" for i in range(len(parts)))
    check_inputs(lhs_mk, parts, group_sizes_g, names)
    num_rows = _num_rows(lhs_mk, lhs_rows_m)
    k = lhs_mk.shape[1]
    _, rk, rn = parts[0].shape
    if transpose_rhs:
        rk, rn = rn, rk
    part_k, rk = rk, rk * len(parts)
    if rk != k:
        shapes = parts[0].shape if len(parts) == 1 else f"{len(parts)} x {parts[0].shape}"
        raise ValueError(f"lhs K={k} must equal rhs K={rk} (rhs shape {shapes}, {transpose_rhs=})")
    out_dtype = jnp.dtype(lhs_mk.dtype if out_dtype is None else out_dtype)
    if out_dtype not in (jnp.dtype(lhs_mk.dtype), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype {out_dtype} must be the lhs dtype {lhs_mk.dtype} or float32")
    if row_scale_m is not None and (
        row_scale_m.shape != (num_rows,) or row_scale_m.dtype != jnp.float32
    ):
        raise ValueError(
            f"row_scale_m must be float32 [M={num_rows}], got {row_scale_m.dtype} "
            f"{row_scale_m.shape}"
        )
    if config is None:
        config = _default_config(
            tuning.gmm_shape_class(transpose_rhs=transpose_rhs, out_dtype=out_dtype),
            n=rn,
            itemsize=lhs_mk.dtype.itemsize,
            out_itemsize=out_dtype.itemsize,
            num_rhs=1,
            interpret=interpret,
        )
        config = _without_clusters(config, lhs_rows_m)
    check_config(
        config,
        k=k,
        n=rn,
        itemsize=lhs_mk.dtype.itemsize,
        out_itemsize=out_dtype.itemsize,
        num_rhs=1,
    )
    if part_k % config.block_k:
        raise ValueError(
            f"each of the {len(parts)} rhs parts holds K={part_k}: it must be a multiple of "
            f"block_k={config.block_k}"
        )
    _check_rows(lhs_mk, lhs_rows_m, config)
    return _grouped_call(
        lhs_mk,
        parts,
        group_sizes_g,
        transpose_rhs=transpose_rhs,
        row_scale_m=row_scale_m,
        lhs_rows_m=lhs_rows_m,
        out_dtype=out_dtype,
        config=config,
        swiglu=False,
        interpret=interpret,
        rhs_k_parts=len(parts),
    )


def gmm_swiglu(
    lhs_mk: Array,
    w_gate_gkf: Array,
    w_up_gkf: Array,
    group_sizes_g: Array,
    *,
    lhs_rows_m: Array | None = None,
    gate_up_out: bool = False,
    config: TileConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> Array | tuple[Array, Array, Array]:
    """[M, F] in lhs dtype: silu(lhs @ w_gate[g]) * (lhs @ w_up[g]) per row, both products in
    one kernel (two accumulators), SwiGLU in f32; rows past sum(group_sizes_g) are 0. With
    `lhs_rows_m` (int32 [M]) row m reads lhs row lhs_rows_m[m], as in `gmm`. With
    `gate_up_out`, returns (h, gate, up): the same kernel's epilogue also stores its f32 gate
    and up accumulators in lhs dtype ([M, F] each; the bits of gmm's product of each), so a
    backward need not recompute them."""
    check_inputs(lhs_mk, (w_gate_gkf, w_up_gkf), group_sizes_g, ("w_gate", "w_up"))
    _num_rows(lhs_mk, lhs_rows_m)
    k = lhs_mk.shape[1]
    if w_gate_gkf.shape[1] != k:
        raise ValueError(f"lhs K={k} must equal w_gate K (w_gate shape {w_gate_gkf.shape})")
    if config is None:
        config = _default_config(
            "gmm_swiglu",
            n=w_gate_gkf.shape[2],
            itemsize=lhs_mk.dtype.itemsize,
            out_itemsize=lhs_mk.dtype.itemsize,
            num_rhs=2,
            interpret=interpret,
        )
        config = _without_clusters(config, lhs_rows_m)
    check_config(
        config,
        k=k,
        n=w_gate_gkf.shape[2],
        itemsize=lhs_mk.dtype.itemsize,
        out_itemsize=lhs_mk.dtype.itemsize,
        num_rhs=2,
    )
    _check_rows(lhs_mk, lhs_rows_m, config)
    return _grouped_call(
        lhs_mk,
        (w_gate_gkf, w_up_gkf),
        group_sizes_g,
        transpose_rhs=False,
        row_scale_m=None,
        lhs_rows_m=lhs_rows_m,
        out_dtype=jnp.dtype(lhs_mk.dtype),
        config=config,
        swiglu=True,
        interpret=interpret,
        num_outs=3 if gate_up_out else 1,
    )


def _row_sums(parts_tpb: Array, group_sizes_g: Array, *, num_rows: int, block_m: int) -> Array:
    """f32 [M]: each row's sum of its partials, parts_tpb[t, :, b] of the tile t that stores it
    (its group's tile holding it, at position b), summed over the column owners in a fixed
    order (one XLA reduction of a static shape); 0 for rows past every group, whose gathered
    slots (tile 0's, which may never have been written) are masked out. Gathers only
    (invariant 10)."""
    # The tiles of tile_schedule (one formula for both: a row's tile here is the one that stores
    # it there).
    ends_x, base_x, _, first_tile_x = _group_tiles(
        group_sizes_g, num_rows=num_rows, block_m=block_m
    )
    row_m = jnp.arange(num_rows, dtype=jnp.int32)
    group_m = jnp.searchsorted(ends_x, row_m, side="right", method="scan_unrolled")
    offset_m = row_m - base_x[group_m]
    tile_m = first_tile_x[group_m] + offset_m // block_m
    in_group = group_m < group_sizes_g.shape[0]
    sums = jnp.sum(parts_tpb[jnp.where(in_group, tile_m, 0), :, offset_m % block_m], axis=1)
    return jnp.where(in_group, sums, 0.0)


def gmm_swiglu_bwd(
    lhs_mk: Array,
    dy_mn: Array,
    w_gate_gkf: Array,
    w_up_gkf: Array,
    w_down_gfn: Array,
    group_sizes_g: Array,
    *,
    row_scale_m: Array | None = None,
    config: TileConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[Array, Array, Array | None]:
    """The expert MLP's backward up to its last GEMMs, in one kernel (invariant 10).

    For y = s * (h @ w_down[g]), h = silu(gate) * up, gate = lhs @ w_gate[g], up = lhs @ w_up[g]
    and the cotangent dy of y ([M, N] in lhs dtype), each output tile runs three products over
    K = D in one pipeline, gate and up from lhs and g = dy @ w_down[g].T from dy, and its
    epilogue forms, in f32 (dh = s * g):

      h       [M, F] lhs dtype   the forward's bits (its epilogue formula)
      d_gate_up [M, 2F]          [dh * up * silu'(gate) | dh * silu(gate)], lhs dtype
      d_s     [M] f32            rowsum over F of h * g, h as stored (None without row_scale_m)

    so no f32 [M, F] intermediate reaches HBM. The caller's remaining GEMMs: d_lhs =
    gmm(d_gate_up, (w_gate, w_up), transpose_rhs=True), [d_w_gate, d_w_up] = tgmm(lhs,
    d_gate_up, out_parts=2), d_w_down = tgmm(h, s * dy). Rows past sum(group_sizes_g) are 0
    in every output. No gathered rows, no clusters.
    """
    check_inputs(lhs_mk, (w_gate_gkf, w_up_gkf), group_sizes_g, ("w_gate", "w_up"))
    num_rows, k = lhs_mk.shape
    g, _, f = w_gate_gkf.shape
    if w_gate_gkf.shape[1] != k:
        raise ValueError(f"lhs K={k} must equal w_gate K (w_gate shape {w_gate_gkf.shape})")
    if dy_mn.shape != (num_rows, k) or dy_mn.dtype != lhs_mk.dtype:
        raise ValueError(
            f"dy must be {lhs_mk.dtype} [M={num_rows}, N={k}] (N = lhs K), got {dy_mn.dtype} "
            f"{dy_mn.shape}"
        )
    if w_down_gfn.shape != (g, f, k) or w_down_gfn.dtype != lhs_mk.dtype:
        raise ValueError(
            f"w_down must be {lhs_mk.dtype} [G={g}, F={f}, N={k}], got {w_down_gfn.dtype} "
            f"{w_down_gfn.shape}"
        )
    if row_scale_m is not None and (
        row_scale_m.shape != (num_rows,) or row_scale_m.dtype != jnp.float32
    ):
        raise ValueError(
            f"row_scale_m must be float32 [M={num_rows}], got {row_scale_m.dtype} "
            f"{row_scale_m.shape}"
        )
    itemsize = lhs_mk.dtype.itemsize
    if config is None:
        config = _default_config(
            "gmm_swiglu_bwd",
            n=f,
            itemsize=itemsize,
            out_itemsize=itemsize,
            num_rhs=3,
            num_lhs=2,
            interpret=interpret,
            dim="F",
        )
    if config.cluster_size != 1:
        raise ValueError(f"gmm_swiglu_bwd runs without clusters, got {config}")
    check_config(
        config, k=k, n=f, itemsize=itemsize, out_itemsize=itemsize, num_rhs=3, num_lhs=2, dim="F"
    )
    outs = _grouped_call(
        lhs_mk,
        (w_gate_gkf, w_up_gkf, w_down_gfn),
        group_sizes_g,
        transpose_rhs=False,
        row_scale_m=row_scale_m,
        lhs_rows_m=None,
        out_dtype=jnp.dtype(lhs_mk.dtype),
        config=config,
        swiglu=False,
        interpret=interpret,
        num_outs=2 if row_scale_m is None else 3,
        dy_mk=dy_mn,
    )
    if row_scale_m is None:
        return outs[0], outs[1], None
    h, d_gate_up, parts_tpb = outs
    if num_rows == 0 or g == 0 or k == 0:
        return h, d_gate_up, jnp.zeros((num_rows,), jnp.float32)
    d_s = _row_sums(parts_tpb, group_sizes_g, num_rows=num_rows, block_m=config.block_m)
    return h, d_gate_up, d_s


__all__ = [
    "INPUT_DTYPES",
    "ProgramsGemm",
    "default_config",
    "gmm",
    "gmm_swiglu",
    "gmm_swiglu_bwd",
    "group_bounds",
    "programs_body",
    "programs_config",
    "schedule_table",
    "tile_schedule",
]
