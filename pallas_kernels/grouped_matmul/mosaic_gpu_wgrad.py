"""The weight-gradient grouped GEMM (transposed ragged dot) as a Mosaic GPU kernel for sm90.

  out[g] = lhs[rows of g].T @ rhs[rows of g]      [M, K] x [M, N] -> [G, K, N]

`reference.tgmm` is the spec. This file: the tile config, the kernel body, the public wrapper.
Tiles come from `tuning.TileConfig` (shape class "tgmm"): block_m tiles K, block_n tiles N,
block_k is the number of a group's rows per step. One persistent kernel: each CTA walks its work
units (output tiles; with cluster_m = 2, a cluster of two CTAs walks pairs of K tiles); a memory
warpgroup loads the row blocks of all of them, in order, into one ring of SMEM stages that the
compute warpgroups (wgmma) drain (see `_tgmm_kernel`).

Tile order (TileConfig.grid_minor_dim, grid_tile_width): the work units are (group, K tile,
N tile), group-major. Within a group, `plgpu.planar_snake` walks the (K tiles, N tiles) grid as
the forward kernel walks its (row tiles, N tiles): "m" is the output's rows, which for tgmm are
the K tiles. grid_minor_dim="m": bands of `grid_tile_width` K tiles; within a band, N tile after
N tile, each with all of the band's K tiles; the N direction reverses from band to band. "n":
bands of N tiles, K tiles within. The order only decides which CTA computes a tile and when (L2
reuse of a group's rows); every tile's bits are the same in any order.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import ring, tuning
from pallas_kernels.grouped_matmul.tuning import TileConfig

_INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_OUTPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Mosaic GPU's TMA copies into 8-row-tiled SMEM address GMEM in whole 8-row tiles, so a row
# block may start only on a multiple of 8 (and M must be one: other M are padded). A group's
# row blocks start at its first row rounded down to a multiple of 8; the kernel zeroes the rows
# of its neighbours in SMEM (invariant 3).
_ROW_ALIGN = 8
_WG_AXIS = "wg"
_SM_AXIS = "sm"
_CLUSTER_AXIS = "cluster_m"
# Columns of `row_blocks`'s table: per group, its row blocks (invariant 2 of `_tgmm_kernel`).
_BASE, _LEAD, _NUM_BLOCKS, _TAIL_END = range(4)


def check_config(config: TileConfig) -> None:
    """Raises ValueError if `tgmm` cannot run `config` (beyond TileConfig's own checks).

    For tgmm, block_m tiles K (the output's rows), block_n tiles N and block_k is the number of
    a group's rows per step (one SMEM stage).
    """
    if config.cluster_n != 1:
        raise ValueError(
            f"tgmm pairs CTAs only along its output's rows (cluster_m): cluster_n must be 1, "
            f"got {config.cluster_n}"
        )
    if config.consumer_dim != "n":
        raise ValueError(
            f"tgmm splits an output tile's columns between its consumers: consumer_dim must be "
            f"'n', got {config.consumer_dim!r}"
        )


def default_config(num_k: int, num_n: int) -> TileConfig:
    """The table's tgmm tiles, narrowed where K or N is not a multiple of them."""
    config = tuning.default_config("tgmm")
    block_m = config.block_m if num_k % config.block_m == 0 else 64
    block_n, num_consumers = config.block_n, config.num_consumers
    if num_n % block_n:
        block_n, num_consumers = (128, 2) if num_n % 128 == 0 else (64, 1)
    epi_m, epi_n = config.epilogue_tile
    return dataclasses.replace(
        config,
        block_m=block_m,
        block_n=block_n,
        num_consumers=num_consumers,
        epi_block_m=min(epi_m, block_m),
        epi_block_n=min(epi_n, block_n // num_consumers),
    )


def unit_tile(unit, *, units_k: int, units_n: int, config: TileConfig):
    """(group, K tile, N tile) of work unit `unit` (int32 scalars).

    Units are group-major: units [g * units_k * units_n, (g + 1) * units_k * units_n) are
    group g's. Within a group, `plgpu.planar_snake` over (K tiles, N tiles): bands of
    `config.grid_tile_width` K tiles for grid_minor_dim="m" (tgmm's output rows are K), of N
    tiles for "n". A bijection from [0, G * units_k * units_n) onto the (g, k, n) tiles.
    With cluster_m = 2, units_k counts pairs of K tiles (the caller maps a pair to its CTA's
    tile).
    """
    per_group = units_k * units_n
    k_idx, n_idx = plgpu.planar_snake(
        lax.rem(unit, per_group),
        (units_k, units_n),
        0 if config.grid_minor_dim == "m" else 1,
        config.grid_tile_width,
    )
    return unit // per_group, k_idx, n_idx


def row_blocks(group_sizes_g: Array, *, num_rows: int, block_rows: int) -> Array:
    """int32 [G, 4]: each group's row blocks, the scalars `_tgmm_kernel` reads per unit.

    Groups are clipped at `num_rows`. Columns (`_BASE`, `_LEAD`, `_NUM_BLOCKS`, `_TAIL_END`):
    base, the group's first row rounded down to a multiple of 8 (block i is rows
    base + i * block_rows + [0, block_rows)); lead, the group's first row's position in block 0
    (in [0, 8)); num_blocks (0 for an empty group); tail_end, the position just past the
    group's last row in its last block (in [1, block_rows]; 0 for an empty group).
    """
    ends_g = jnp.minimum(jnp.cumsum(group_sizes_g), num_rows)
    starts_g = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_g[:-1]])
    sizes_g = ends_g - starts_g
    lead_g = starts_g % _ROW_ALIGN
    num_blocks_g = jnp.where(sizes_g > 0, pl.cdiv(lead_g + sizes_g, block_rows), 0)
    tail_end_g = jnp.where(sizes_g > 0, lead_g + sizes_g - (num_blocks_g - 1) * block_rows, 0)
    return jnp.stack([starts_g - lead_g, lead_g, num_blocks_g, tail_end_g], axis=1)


def _swizzled(minor_elems: int, dtype: Any) -> tuple[Any, ...]:
    """SMEM transforms of a tile whose minor dimension holds `minor_elems` elements."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _zero_rows_outside(rhs_wg, *, first, end, block_m: int, wg_tile_n: int) -> None:
    """Invariant 3: sets the rows of a block outside [first, end), the group's, to +0 in this
    warpgroup's [block_m, wg_tile_n] rhs columns (a select, so that a NaN there cannot reach
    the sums). Only blocks that hold such rows (a group's first and last) are touched."""

    @pl.when((first > 0) | (end < block_m))
    def _mask_outside_rows():
        rows = plgpu.broadcasted_iota(jnp.int32, (block_m, wg_tile_n), 0, layout=plgpu.Layout.WGMMA)
        values = rhs_wg[...]
        inside = (rows >= first) & (rows < end)
        rhs_wg[...] = jnp.where(inside, values, jnp.zeros_like(values))
        plgpu.commit_smem()


def _store_unit(
    acc,
    out_refs,
    out_smem,
    *,
    wg,
    wg_n_slice,
    tile,
    tile_k: int,
    tile_n: int,
    part_units_n: int,
    epilogue_tile: tuple[int, int],
) -> None:
    """The epilogue: this warpgroup's columns of output tile (g, K tile, N tile), acc [tile_k,
    wg_tile_n] cast to the output dtype, through its two SMEM slots to a TMA store, in [epi_k,
    epi_n] sub-tiles. With out_parts, into the part that holds the N tile (invariant 8).
    Columns or rows past K or N are dropped by the TMA store."""
    g, k_idx, n_idx = tile
    epilogue_k, epilogue_n = epilogue_tile
    wg_tile_n = acc.shape[1]
    # The previous unit's stores must have read out_smem before it is reused.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    k_slice = pl.ds(k_idx * tile_k, tile_k)

    def store(out_ref, part):
        n_slice = pl.ds((n_idx - part * part_units_n) * tile_n, tile_n)
        out_tile = out_ref.at[g, k_slice, n_slice].at[:, wg_n_slice]
        sub_n = wg_tile_n // epilogue_n
        for ek in range(tile_k // epilogue_k):
            for en in range(sub_n):
                slot = (ek * sub_n + en) % 2
                rows = slice(ek * epilogue_k, (ek + 1) * epilogue_k)
                cols = slice(en * epilogue_n, (en + 1) * epilogue_n)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                out_smem[wg, slot] = acc[rows, cols]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_tile.at[rows, cols])

    if len(out_refs) == 1:
        store(out_refs[0], 0)
    for part, out_ref in enumerate(out_refs if len(out_refs) > 1 else ()):
        in_part = n_idx // part_units_n == part
        pl.when(in_part)(functools.partial(store, out_ref, part))


def _tgmm_kernel(
    blocks_g_ref,
    lhs_mk_ref,
    rhs_mn_ref,
    *out_refs,
    config: TileConfig,
    num_groups: int,
):
    """One persistent CTA: a compute warpgroup per column slice, one memory warpgroup.

    The memory warpgroup TMA-loads the row blocks of every unit of this CTA, unit after unit,
    into a ring of `max_concurrent_steps` SMEM stages; it runs ahead of the compute warpgroups
    by up to a full ring, across unit boundaries (the next unit's first blocks load while the
    compute warpgroups finish a unit and run its epilogue). A unit's scalars (its group's row
    blocks: a row of `blocks_g_ref`, from `row_blocks`) are loaded one unit ahead and carried,
    so that no warpgroup waits for a GMEM load at the top of a unit (see `unit_loop`).

    Invariants:
      1. Each output tile [g, k tile, n tile] is one work unit (unit_tile maps the units onto
         the tiles one to one, in the config's order; with cluster_m = 2 a unit is a pair of
         K tiles, one a CTA of the cluster, invariant 7), owned by one CTA; within it each
         compute warpgroup owns its own columns. Every output element has exactly one writer, and
         it is written once, also for an empty group (zeros). No atomics, no split-K.
      2. A unit accumulates its group's rows in order, in blocks of block_m rows that start at
         base = start - start % 8 (the group's first row rounded down to a multiple of 8: TMA
         into 8-row-tiled SMEM needs that): block i holds rows base + i * block_m + [0, block_m),
         and the group's row of rank r sits at position start % 8 + r of the concatenated
         blocks. So the result depends only on the group's rows and on start % 8: moving a group
         by a multiple of 8 rows keeps its bits (every group of an 8-row-aligned layout, as the
         layer lays them out, gets the same bits wherever it starts). A move by another amount
         changes which rows share a wgmma's reduction, and may change the last bits.
      3. Rows of a block outside the group (the previous group's rows before `start` in the
         first block, the next group's rows, rows of no group, or rows past M that TMA fills
         with zeros, after the group's end in the last block) are set to +0 in the rhs tile
         before the MMA of those two steps only, so they add exact zeros (finite lhs values
         outside the group assumed). Every other step is whole rows of the group. The rhs
         rows are replaced (a select), not multiplied by a mask: the exchange's buffers leave
         rows past the groups unspecified, and NaN there must not reach the sums
         (pallas_kernels/exchange/protocol.py, TAIL_ZERO_ROWS).
      4. Accumulation is f32 in registers (wgmma); one cast at the store.
      5. A stage is refilled only after every compute warpgroup released it, and a warpgroup
         releases a stage only after the wgmmas that read it completed: with delay_release=0
         right after the step's wgmma_wait(0); with delay_release=1 at the next step of the
         unit (after wgmma_wait(1)), and a unit's last stage after its final wgmma_wait(0).
         The memory warpgroup waits on a stage's `consumed` barrier before every reuse.
      6. The memory and compute warpgroups walk the same units in the same order and count the
         same row blocks (a carry of the unit loop; each reads a unit's block count from the
         unit's own group's row of `blocks_g_ref`, loaded one unit ahead), so step s always
         uses stage s % max_concurrent_steps and every barrier's phases are waited in order,
         each exactly once by each waiter. Units of empty groups load nothing and store zeros.
      7. With cluster_m = 2, a unit is a pair of K tiles 2j, 2j + 1 of one (group, N tile),
         computed by the two CTAs of a cluster: they read the same row blocks in the same
         order, so each stage's rhs block is loaded once and multicast into both (each CTA
         then zeroes the outside rows of its own copy, invariant 3), and a stage is refilled
         only after the compute warpgroups of both CTAs released it (a cluster barrier). No
         group is padded: every unit of a pair holds rows of the same group. The GPU
         interpreter does not model multicast (each CTA copies its own source), so the
         interpret tests hold the arrivals, phases and tile mapping, and the GPU test
         (test_gpu_clusters_of_two_k_tiles_give_the_single_cta_bits) the cross-CTA side.
      8. With several outputs (`out_parts`), output p holds columns [p * N / P, (p + 1) * N / P)
         of the one product: a unit's N tile lies in one part (N / P is a multiple of the
         tile width, checked) and is stored there; the units, their rows and their order are
         those of the single output, so each part has the bits of its columns of it.
    """
    num_k, num_n = lhs_mk_ref.shape[1], rhs_mn_ref.shape[1]
    # Names in this kernel: block_m rows of a group per step, an output tile [tile_k, tile_n].
    block_m, tile_k, tile_n = config.block_k, config.block_m, config.block_n
    wg_tile_n = config.consumer_n
    num_consumers = config.num_consumers
    stages = config.max_concurrent_steps
    delay = config.delay_release
    units_k, units_n = pl.cdiv(num_k, tile_k), pl.cdiv(num_n, tile_n)
    paired = config.cluster_m == 2
    # With clusters, a unit is a pair of K tiles (invariant 7).
    units_k //= config.cluster_m
    epilogue_k, epilogue_n = config.epilogue_tile
    out_dtype = out_refs[0].dtype
    part_units_n = units_n // len(out_refs)  # N tiles of each output part (invariant 8)
    in_dtype = lhs_mk_ref.dtype

    units_per_group = units_k * units_n
    num_units = num_groups * units_per_group

    def tile_of(unit):
        g, k_idx, n_idx = unit_tile(unit, units_k=units_k, units_n=units_n, config=config)
        if paired:
            k_idx = k_idx * 2 + lax.axis_index(_CLUSTER_AXIS)
        return g, k_idx, n_idx

    def unit_loop(*columns):
        """This CTA's units in order: `body(unit, steps, *values) -> steps` runs unit `unit`
        after `steps` ring steps (row blocks) and returns the count after it; `values` are the
        `columns` of the unit's group in `blocks_g_ref`.

        The values of the CTA's next unit are loaded while the current one runs
        (`ring.prefetching_loop`)."""

        def load(unit):
            g = unit // units_per_group
            return tuple(blocks_g_ref[g, column] for column in columns)

        def decorator(body):
            @ring.prefetching_loop(num_units, load, axis=_SM_AXIS)
            def steps(unit, step0, values):
                return body(unit, step0, *values)

            return steps

        return decorator

    @functools.partial(
        pl.run_scoped,
        lhs_smem=plgpu.SMEM(
            (stages, block_m, tile_k), in_dtype, transforms=_swizzled(tile_k, in_dtype)
        ),
        rhs_smem=plgpu.SMEM(
            (stages, block_m, tile_n), in_dtype, transforms=_swizzled(tile_n, in_dtype)
        ),
        out_smem=plgpu.SMEM(
            (num_consumers, 2, epilogue_k, epilogue_n),
            out_dtype,
            transforms=_swizzled(epilogue_n, out_dtype),
        ),
        loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        consumed=(
            plgpu.ClusterBarrier(
                collective_axes=(_CLUSTER_AXIS,),
                num_arrivals=num_consumers,
                num_barriers=stages,
            )
            if paired
            else plgpu.Barrier(num_arrivals=num_consumers, num_barriers=stages)
        ),
        collective_axes=_WG_AXIS,
    )
    def _scope(lhs_smem, rhs_smem, out_smem, loaded, consumed):
        wg = lax.axis_index(_WG_AXIS)

        # 1. The memory warpgroup: every row block of every unit of this CTA, in order, into
        #    the ring (invariants 5, 6). The gmem blocks start at the group's first row rounded
        #    down to a multiple of 8 (invariant 2); blocks that run past the end of M read zeros
        #    (TMA out-of-bounds fill).
        @pl.when(wg == num_consumers)
        def _memory():
            plgpu.set_max_registers(ring.PRODUCER_REGISTERS, action="decrease")

            @unit_loop(_BASE, _NUM_BLOCKS)
            def num_steps(unit, step0, base, num_blocks):
                _, k_idx, n_idx = tile_of(unit)
                k_slice = pl.ds(k_idx * tile_k, tile_k)
                n_slice = pl.ds(n_idx * tile_n, tile_n)

                @pl.loop(0, num_blocks)
                def _load_block(i):
                    slot = ring.acquire_stage(consumed, step=step0 + i, stages=stages)

                    rows = pl.ds(pl.multiple_of(base + i * block_m, _ROW_ALIGN), block_m)
                    plgpu.copy_gmem_to_smem(
                        lhs_mk_ref.at[rows, k_slice], lhs_smem.at[slot], loaded.at[slot]
                    )
                    plgpu.copy_gmem_to_smem(
                        rhs_mn_ref.at[rows, n_slice],
                        rhs_smem.at[slot],
                        loaded.at[slot],
                        collective_axes=_CLUSTER_AXIS if paired else None,
                    )

                return step0 + num_blocks

            ring.observe_last_releases(consumed, num_steps, stages)

        # 2. The compute warpgroups: wgmma over the unit's row blocks into an f32 accumulator,
        #    each warpgroup its own columns, then the epilogue.
        @pl.when(wg < num_consumers)
        def _compute():
            plgpu.set_max_registers(ring.consumer_registers(num_consumers), action="increase")
            wg_n_slice = pl.ds(pl.multiple_of(wg * wg_tile_n, wg_tile_n), wg_tile_n)

            @unit_loop(_LEAD, _NUM_BLOCKS, _TAIL_END)
            def _units(unit, step0, lead, num_blocks, tail_end):
                # The group's rows are positions [lead, lead + size) of the unit's blocks; in
                # the last block, positions [tail_end, block_m) are past its end.
                g, k_idx, n_idx = tile_of(unit)

                # 3. One step: one block of block_m rows, in order (invariant 2).
                def mma_step(i, acc_ref):
                    step = step0 + i
                    slot = lax.rem(step, stages)
                    plgpu.barrier_wait(loaded.at[slot])
                    rhs_wg = rhs_smem.at[slot].at[:, wg_n_slice]

                    # In the first and last blocks, zero the rows outside the group in this
                    # warpgroup's rhs columns (invariant 3). Only the warpgroup that owns the
                    # columns writes them.
                    _zero_rows_outside(
                        rhs_wg,
                        first=jnp.where(i == 0, lead, 0),
                        end=jnp.where(i == num_blocks - 1, tail_end, block_m),
                        block_m=block_m,
                        wg_tile_n=wg_tile_n,
                    )

                    # lhs block [block_m, tile_k] transposed is the A operand [tile_k, block_m].
                    plgpu.wgmma(acc_ref, lhs_smem.at[slot].transpose((1, 0)), rhs_wg)
                    # Invariant 5: a stage is released once the wgmmas reading it are done.
                    ring.release_after_wgmma(
                        consumed,
                        step=step,
                        first_of_item=i == 0,
                        delay=delay,
                        groups_per_step=1,
                        stages=stages,
                    )
                    return acc_ref

                # 4. Epilogue: registers -> SMEM -> TMA store, in sub-tiles, two SMEM slots per
                #    warpgroup. Columns or rows past K or N are dropped by the TMA store.
                def acc_scope(acc_ref):
                    acc_ref = lax.fori_loop(0, num_blocks, mma_step, acc_ref)

                    @pl.when(num_blocks > 0)
                    def _release_the_last_stage():
                        last_step = step0 + num_blocks - 1
                        ring.release_last(consumed, last_step=last_step, delay=delay, stages=stages)

                    acc = acc_ref[...].astype(out_dtype)
                    _store_unit(
                        acc,
                        out_refs,
                        out_smem,
                        wg=wg,
                        wg_n_slice=wg_n_slice,
                        tile=(g, k_idx, n_idx),
                        tile_k=tile_k,
                        tile_n=tile_n,
                        part_units_n=part_units_n,
                        epilogue_tile=config.epilogue_tile,
                    )

                pl.run_scoped(acc_scope, plgpu.ACC((tile_k, wg_tile_n), jnp.float32))
                return step0 + num_blocks

            plgpu.wait_smem_to_gmem(0)


def tgmm(
    lhs_mk: Array,
    rhs_mn: Array,
    group_sizes_g: Array,
    *,
    config: TileConfig | None = None,
    out_dtype: Any = jnp.float32,
    out_parts: int = 1,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> Array | tuple[Array, ...]:
    """[G, K, N]: per group g, lhs[rows of g].T @ rhs[rows of g] (see reference.tgmm).

    With out_parts = P > 1, a tuple of P arrays [G, K, N / P]: the product's consecutive column
    blocks, stored by the kernel into separate arrays (invariant 8; the backward's d_w_gate and
    d_w_up without slicing a [G, K, 2F] product), each the bits of its columns of the single
    product. N / P must be a multiple of the tile width (block_n).

    lhs_mk: [M, K] and rhs_mn: [M, N], bf16 or f16 (the same); group_sizes_g: int32 [G].
    K and N must be multiples of 64 (with config.cluster_m = 2, K must also hold an even number
    of block_m tiles). Rows past sum(group_sizes_g) belong to no group; groups
    are clipped at M. Empty groups give zeros. Every lhs row must be finite, also rows of no
    group and of other groups: a group's first and last 8-row blocks multiply its neighbours'
    lhs rows by zeroed rhs rows, and 0 * inf is NaN (reference.tgmm masks instead; the layer's
    padding rows are zeros). interpret=True (or an InterpretGPUParams, e.g.
    with detect_races) runs the kernel under GPU interpret mode, on any backend.
    """
    if lhs_mk.ndim != 2 or rhs_mn.ndim != 2:
        raise ValueError(f"lhs_mk {lhs_mk.shape} and rhs_mn {rhs_mn.shape} must be 2-D")
    if group_sizes_g.ndim != 1 or group_sizes_g.dtype != jnp.int32:
        raise ValueError(
            f"group_sizes_g must be int32 [G], got {group_sizes_g.dtype}{list(group_sizes_g.shape)}"
        )
    (num_rows, num_k), (rhs_rows, num_n) = lhs_mk.shape, rhs_mn.shape
    if num_rows != rhs_rows:
        raise ValueError(f"lhs_mk rows {num_rows} != rhs_mn rows {rhs_rows}")
    if lhs_mk.dtype != rhs_mn.dtype or lhs_mk.dtype not in _INPUT_DTYPES:
        raise ValueError(
            f"lhs_mk ({lhs_mk.dtype}) and rhs_mn ({rhs_mn.dtype}) must both be bfloat16 or float16"
        )
    if num_k % 64 or num_n % 64 or num_k == 0 or num_n == 0:
        raise ValueError(f"K={num_k} and N={num_n} must be positive multiples of 64")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in _OUTPUT_DTYPES:
        raise ValueError(f"{out_dtype=} must be float32, bfloat16 or float16")
    if not isinstance(out_parts, int) or out_parts < 1 or num_n % (64 * out_parts):
        raise ValueError(
            f"{out_parts=} must be a positive int dividing N={num_n} into multiples of 64"
        )
    part_n = num_n // out_parts
    num_groups = group_sizes_g.shape[0]
    if config is None:
        config = default_config(num_k, part_n)
    check_config(config)
    if out_parts > 1 and part_n % config.block_n:
        raise ValueError(
            f"each of the {out_parts} output parts holds N={part_n} columns: it must be a "
            f"multiple of block_n={config.block_n}"
        )
    if config.cluster_m == 2 and pl.cdiv(num_k, config.block_m) % 2:
        raise ValueError(
            f"cluster_m=2 pairs K tiles: K={num_k} / block_m={config.block_m} must give an even "
            f"number of tiles, got {pl.cdiv(num_k, config.block_m)}"
        )
    epilogue_row_bytes = config.epilogue_tile[1] * out_dtype.itemsize
    if epilogue_row_bytes % 32:
        raise ValueError(
            f"an epilogue sub-tile row of epi_block_n={config.epilogue_tile[1]} {out_dtype} "
            f"values is {epilogue_row_bytes} bytes: it must be a multiple of 32 (the smallest "
            f"SMEM swizzle)"
        )
    if num_groups == 0 or num_rows == 0:
        zeros = jnp.zeros((num_groups, num_k, part_n), out_dtype)
        return zeros if out_parts == 1 else (zeros,) * out_parts
    # Group bounds clipped at M: rows past M belong to no group (as in reference.group_ids).
    blocks_g = row_blocks(group_sizes_g, num_rows=num_rows, block_rows=config.block_k)
    # TMA views the rows in whole 8-row tiles, and its box (block_k rows) may not be taller
    # than the tensor: pad M up to that (a copy of the inputs, only for such M). The padded
    # rows are zeros and belong to no group.
    padded_rows = pl.cdiv(max(num_rows, config.block_k), _ROW_ALIGN) * _ROW_ALIGN
    if padded_rows != num_rows:
        pad = ((0, padded_rows - num_rows), (0, 0))
        lhs_mk, rhs_mn = jnp.pad(lhs_mk, pad), jnp.pad(rhs_mn, pad)
    if interpret:
        # Interpret mode simulates every CTA as a host thread: 2 unless told otherwise.
        grid_size = config.grid_size or 2
        interpret_params: Any = (
            interpret
            if isinstance(interpret, plgpu.InterpretGPUParams)
            else plgpu.InterpretGPUParams()
        )
    else:
        grid_size = config.grid_size or tuning.persistent_grid_size(cluster_size=config.cluster_m)
        interpret_params = None
    cluster = config.cluster_m
    out_type = jax.ShapeDtypeStruct((num_groups, num_k, part_n), out_dtype)
    kernel = plgpu.kernel(
        functools.partial(_tgmm_kernel, config=config, num_groups=num_groups),
        out_type=out_type if out_parts == 1 else (out_type,) * out_parts,
        grid=(max(1, grid_size // cluster),),
        grid_names=(_SM_AXIS,),
        **({} if cluster == 1 else {"cluster": (cluster,), "cluster_names": (_CLUSTER_AXIS,)}),
        num_threads=config.num_consumers + 1,
        thread_name=_WG_AXIS,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params,
    )

    return kernel(blocks_g, lhs_mk, rhs_mn)
