"""The weight-gradient grouped GEMM (transposed ragged dot) as a Mosaic GPU kernel for sm90.

  out[g] = lhs[rows of g].T @ rhs[rows of g]      [M, K] x [M, N] -> [G, K, N]

`reference.tgmm` is the spec. This file: the tile config, the kernel body, the public wrapper.
Tiles come from `tuning.TileConfig` (shape class "tgmm"): block_m tiles K, block_n tiles N,
block_k is the number of a group's rows per pipeline step.

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

from pallas_kernels.grouped_matmul import tuning
from pallas_kernels.grouped_matmul.tuning import TileConfig

_INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_OUTPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Registers the memory warpgroup keeps (it only issues TMA copies).
_MEMORY_REGISTERS = 40
# Mosaic GPU's TMA copies into 8-row-tiled SMEM address GMEM in whole 8-row tiles, so a row
# block may start only on a multiple of 8 (and M must be one: other M are padded). A group's
# row blocks start at its first row rounded down to a multiple of 8; the kernel zeroes the rows
# of its neighbours in SMEM (invariant 3).
_ROW_ALIGN = 8
_WG_AXIS = "wg"
_SM_AXIS = "sm"


def check_config(config: TileConfig) -> None:
    """Raises ValueError if `tgmm` cannot run `config` (beyond TileConfig's own checks).

    For tgmm, block_m tiles K (the output's rows), block_n tiles N and block_k is the number of
    a group's rows per pipeline step.
    """
    if config.delay_release != 0:
        # Each work unit runs its own pipeline over shared buffers: the memory warpgroup starts
        # the next unit's loads once the last stage is released, so that release must come
        # after the stage's wgmma has finished.
        raise ValueError(f"tgmm needs delay_release=0, got {config.delay_release}")
    if config.consumer_n > 256:
        raise ValueError(f"block_n // num_consumers = {config.consumer_n} must be <= 256")


def default_config(num_k: int, num_n: int) -> TileConfig:
    """The table's tgmm tiles, narrowed where K or N is not a multiple of them."""
    config = tuning.default_config("tgmm")
    block_m = config.block_m if num_k % config.block_m == 0 else 64
    block_n, num_consumers = config.block_n, config.num_consumers
    if num_n % block_n:
        block_n, num_consumers = (128, 2) if num_n % 128 == 0 else (64, 1)
    epi_m, epi_n = config.epilogue_tile
    # delay_release=0 is what this kernel runs (see check_config).
    return dataclasses.replace(
        config,
        block_m=block_m,
        block_n=block_n,
        num_consumers=num_consumers,
        delay_release=0,
        epi_block_m=min(epi_m, block_m),
        epi_block_n=min(epi_n, block_n // num_consumers),
    )


def unit_tile(unit, *, units_k: int, units_n: int, config: TileConfig):
    """(group, K tile, N tile) of work unit `unit` (int32 scalars).

    Units are group-major: units [g * units_k * units_n, (g + 1) * units_k * units_n) are
    group g's. Within a group, `plgpu.planar_snake` over (K tiles, N tiles): bands of
    `config.grid_tile_width` K tiles for grid_minor_dim="m" (tgmm's output rows are K), of N
    tiles for "n". A bijection from [0, G * units_k * units_n) onto the (g, k, n) tiles.
    """
    per_group = units_k * units_n
    k_idx, n_idx = plgpu.planar_snake(
        lax.rem(unit, per_group),
        (units_k, units_n),
        0 if config.grid_minor_dim == "m" else 1,
        config.grid_tile_width,
    )
    return unit // per_group, k_idx, n_idx


def _swizzled(minor_elems: int, dtype: Any) -> tuple[Any, ...]:
    """SMEM transforms of a tile whose minor dimension holds `minor_elems` elements."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _tgmm_kernel(
    starts_g_ref,
    sizes_g_ref,
    lhs_mk_ref,
    rhs_mn_ref,
    out_gkn_ref,
    *,
    config: TileConfig,
    num_groups: int,
):
    """One persistent CTA: a compute warpgroup per column slice, one memory warpgroup.

    Invariants:
      1. Each output tile [g, k tile, n tile] is one work unit (unit_tile maps the units onto
         the tiles one to one, in the config's order), owned by one CTA; within it each
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
         outside the group assumed). Every other step is whole rows of the group.
      4. Accumulation is f32 in registers (wgmma); one cast at the store.
    """
    num_rows, num_k = lhs_mk_ref.shape
    num_n = rhs_mn_ref.shape[1]
    # Names in this kernel: block_m rows of a group per step, an output tile [tile_k, tile_n].
    block_m, tile_k, tile_n = config.block_k, config.block_m, config.block_n
    wg_tile_n = config.consumer_n
    units_k, units_n = pl.cdiv(num_k, tile_k), pl.cdiv(num_n, tile_n)
    epilogue_k, epilogue_n = config.epilogue_tile
    out_dtype = out_gkn_ref.dtype
    in_dtype = lhs_mk_ref.dtype

    def make_pipeline(body, compute_context, num_steps):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(num_steps,),
            memory_registers=_MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec(
                    (block_m, tile_k), lambda i: (i, 0), transforms=_swizzled(tile_k, in_dtype)
                ),
                plgpu.BlockSpec(
                    (block_m, tile_n),
                    lambda i: (i, 0),
                    transforms=_swizzled(tile_n, in_dtype),
                ),
            ],
            wg_axis=_WG_AXIS,
            num_compute_wgs=config.num_consumers,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
        )

    # The pipeline's buffers and barriers do not depend on its body; allocate them once for all
    # units so that the memory warpgroup can run ahead into the next unit. (A static grid
    # shorter than the depth would shrink the buffers: give it the full depth.)
    ignore = lambda *_, **__: None  # noqa: E731
    example_lhs = lhs_mk_ref.at[pl.ds(0, block_m), pl.ds(0, tile_k)]
    example_rhs = rhs_mn_ref.at[pl.ds(0, block_m), pl.ds(0, tile_n)]

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=make_pipeline(ignore, ignore, config.max_concurrent_steps).get_allocations(
            example_lhs, example_rhs
        ),
        out_smem=plgpu.SMEM(
            (config.num_consumers, 2, epilogue_k, epilogue_n),
            out_dtype,
            transforms=_swizzled(epilogue_n, out_dtype),
        ),
        collective_axes=_WG_AXIS,
    )
    def _scope(pipeline_allocs, out_smem):
        wg = lax.axis_index(_WG_AXIS)

        # 1. Persistent loop over units (g, k tile, n tile), group-major so that the CTAs at
        #    work at one time share a group's rows in L2; within a group, the config's tile
        #    order (unit_tile).
        @plgpu.nd_loop((num_groups * units_k * units_n,), collective_axes=_SM_AXIS)
        def _unit(loop_info: plgpu.NDLoopInfo):
            (unit,) = loop_info.index
            g, k_idx, n_idx = unit_tile(unit, units_k=units_k, units_n=units_n, config=config)
            start = starts_g_ref[g]
            size = sizes_g_ref[g]
            # Invariant 2: the group's rows are positions [lead, lead + size) of its blocks.
            lead = lax.rem(start, _ROW_ALIGN)
            base = pl.multiple_of(start - lead, _ROW_ALIGN)
            num_blocks = jnp.where(size > 0, pl.cdiv(lead + size, block_m), 0)
            # Positions past the group's end in the last block: [tail_end, block_m).
            tail_end = lead + size - (num_blocks - 1) * block_m
            k_slice = pl.ds(k_idx * tile_k, tile_k)
            n_slice = pl.ds(n_idx * tile_n, tile_n)
            wg_n_slice = pl.ds(pl.multiple_of(wg * wg_tile_n, wg_tile_n), wg_tile_n)

            # 2. One pipeline step: one block of block_m rows, in order (invariant 2).
            def mma_step(indices, lhs_smem, rhs_smem, acc_ref):
                (step,) = indices
                rhs_wg = rhs_smem.at[:, wg_n_slice]

                # 3. In the first and last blocks, zero the rows outside the group in this
                #    warpgroup's rhs columns (invariant 3): rows [lo, hi) of the block are the
                #    group's. Only the warpgroup that owns the columns writes them.
                is_first, is_last = step == 0, step == num_blocks - 1
                lo = jnp.where(is_first, lead, 0)
                hi = jnp.where(is_last, tail_end, block_m)

                @pl.when((lo > 0) | (hi < block_m))
                def _mask_outside_rows():
                    rows = plgpu.broadcasted_iota(
                        jnp.int32, (block_m, wg_tile_n), 0, layout=plgpu.Layout.WGMMA
                    )
                    values = rhs_wg[...]
                    inside = (rows >= lo) & (rows < hi)
                    rhs_wg[...] = jnp.where(inside, values, jnp.zeros_like(values))
                    plgpu.commit_smem()

                # lhs tile [block_m, tile_k] transposed is the A operand [tile_k, block_m].
                plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), rhs_wg)
                plgpu.wgmma_wait(0)
                return acc_ref

            # 4. Epilogue: registers -> SMEM -> TMA store, in sub-tiles, two SMEM slots per
            #    warpgroup. Columns or rows past K or N are dropped by the TMA store.
            def compute_context(run_pipeline):
                @functools.partial(
                    pl.run_scoped, acc_ref=plgpu.ACC((tile_k, wg_tile_n), jnp.float32)
                )
                def _acc_scope(acc_ref):
                    run_pipeline(acc_ref)
                    acc = acc_ref[...].astype(out_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    out_tile = out_gkn_ref.at[g, k_slice, n_slice].at[:, wg_n_slice]
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

            # The gmem views start at the group's first row rounded down to a multiple of 8
            # (invariant 2); blocks that run past the end of M read zeros (TMA out-of-bounds
            # fill). An empty group runs no step: its unit stores zeros.
            make_pipeline(mma_step, compute_context, num_blocks)(
                lhs_mk_ref.at[pl.ds(base, num_rows), k_slice],
                rhs_mn_ref.at[pl.ds(base, num_rows), n_slice],
                allocations=pipeline_allocs,
            )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def tgmm(
    lhs_mk: Array,
    rhs_mn: Array,
    group_sizes_g: Array,
    *,
    config: TileConfig | None = None,
    out_dtype: Any = jnp.float32,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> Array:
    """[G, K, N]: per group g, lhs[rows of g].T @ rhs[rows of g] (see reference.tgmm).

    lhs_mk: [M, K] and rhs_mn: [M, N], bf16 or f16 (the same); group_sizes_g: int32 [G].
    K and N must be multiples of 64. Rows past sum(group_sizes_g) belong to no group; groups
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
    num_groups = group_sizes_g.shape[0]
    if config is None:
        config = default_config(num_k, num_n)
    check_config(config)
    if num_groups == 0:
        return jnp.zeros((0, num_k, num_n), out_dtype)
    if num_rows == 0:
        return jnp.zeros((num_groups, num_k, num_n), out_dtype)
    # Group bounds clipped at M: rows past M belong to no group (as in reference.group_ids).
    ends_g = jnp.minimum(jnp.cumsum(group_sizes_g), num_rows)
    starts_g = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_g[:-1]])
    sizes_g = ends_g - starts_g
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
        grid_size = config.grid_size or tuning.persistent_grid_size()
        interpret_params = None
    kernel = plgpu.kernel(
        functools.partial(_tgmm_kernel, config=config, num_groups=num_groups),
        out_type=jax.ShapeDtypeStruct((num_groups, num_k, num_n), out_dtype),
        grid=(grid_size,),
        grid_names=(_SM_AXIS,),
        num_threads=config.num_consumers + 1,
        thread_name=_WG_AXIS,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params,
    )

    return kernel(starts_g, sizes_g, lhs_mk, rhs_mn)
