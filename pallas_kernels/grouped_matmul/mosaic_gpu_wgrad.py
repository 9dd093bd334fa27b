"""The weight-gradient grouped GEMM (transposed ragged dot) as a Mosaic GPU kernel for sm90.

  out[g] = lhs[rows of g].T @ rhs[rows of g]      [M, K] x [M, N] -> [G, K, N]

`reference.tgmm` is the spec. This file: the tile config, the kernel body, the public wrapper.
Tiles come from `tuning.TileConfig` (shape class "tgmm"): block_m tiles K, block_n tiles N,
block_k is the number of a group's rows per pipeline step.
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
# block may start only on a multiple of 8 (and M must be one). Groups that start elsewhere are
# first repacked so that each starts on a multiple of 8 (see `_align_groups`).
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
      1. Each output tile [g, k tile, n tile] is one work unit, owned by one CTA; within it each
         compute warpgroup owns its own columns. Every output element has exactly one writer, and
         it is written once, also for an empty group (zeros). No atomics, no split-K.
      2. A unit accumulates its group's rows in order, in blocks of block_m rows that START AT
         THE GROUP'S FIRST ROW: block i holds rows start + i * block_m + [0, block_m). A row's
         position inside its block, and the order of the blocks, depend only on the row's rank in
         its group, so the result depends only on the group's rows, never on where the group
         starts in M (the same bits for every expert-parallel layout). Every start is a multiple
         of 8 here (the wrapper repacks the rows otherwise, keeping each group's rows in order).
      3. In a group's last block, rows past the group's end (the next group's rows, rows of no
         group, or rows past M, which TMA fills with zeros) are set to +0 in the rhs tile before
         the MMA, so they add exact zeros (finite lhs values outside the group assumed).
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
        #    work at one time share a group's rows in L2.
        @plgpu.nd_loop((num_groups * units_k * units_n,), collective_axes=_SM_AXIS)
        def _unit(loop_info: plgpu.NDLoopInfo):
            (unit,) = loop_info.index
            g = unit // (units_k * units_n)
            k_idx = lax.rem(unit, units_k * units_n) // units_n
            n_idx = lax.rem(unit, units_n)
            start = pl.multiple_of(starts_g_ref[g], _ROW_ALIGN)
            size = sizes_g_ref[g]
            num_blocks = pl.cdiv(size, block_m)
            # Valid rows in the last block, in [1, block_m] for a non-empty group.
            last_rows = size - (num_blocks - 1) * block_m
            k_slice = pl.ds(k_idx * tile_k, tile_k)
            n_slice = pl.ds(n_idx * tile_n, tile_n)
            wg_n_slice = pl.ds(pl.multiple_of(wg * wg_tile_n, wg_tile_n), wg_tile_n)

            # 2. One pipeline step: one block of block_m rows, in order (invariant 2).
            def mma_step(indices, lhs_smem, rhs_smem, acc_ref):
                (step,) = indices
                rhs_wg = rhs_smem.at[:, wg_n_slice]

                # 3. Zero the rows past the group's end in this warpgroup's rhs columns
                #    (invariant 3); only the warpgroup that owns the columns writes them.
                @pl.when((step == num_blocks - 1) & (last_rows < block_m))
                def _mask_tail():
                    rows = plgpu.broadcasted_iota(
                        jnp.int32, (block_m, wg_tile_n), 0, layout=plgpu.Layout.WGMMA
                    )
                    values = rhs_wg[...]
                    rhs_wg[...] = jnp.where(rows < last_rows, values, jnp.zeros_like(values))
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

            # The gmem views start at the group's first row (invariant 2); blocks that run past
            # the end of M read zeros (TMA out-of-bounds fill).
            make_pipeline(mma_step, compute_context, num_blocks)(
                lhs_mk_ref.at[pl.ds(start, num_rows), k_slice],
                rhs_mn_ref.at[pl.ds(start, num_rows), n_slice],
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
    are clipped at M. Empty groups give zeros. interpret=True (or an InterpretGPUParams, e.g.
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

    def run_aligned():
        return kernel(starts_g, sizes_g, lhs_mk, rhs_mn)

    def run_repacked():
        lhs_rk, rhs_rn, starts_r = _align_groups(lhs_mk, rhs_mn, starts_g, sizes_g, config.block_k)
        return kernel(starts_r, sizes_g, lhs_rk, rhs_rn)

    if num_rows % _ROW_ALIGN or num_rows < config.block_k:
        return run_repacked()
    # Both give the same bits (invariant 2); the direct call saves a pass over the inputs.
    aligned = jnp.all(starts_g % _ROW_ALIGN == 0)
    return lax.cond(aligned, run_aligned, run_repacked)


def _align_groups(
    lhs_mk: Array, rhs_mn: Array, starts_g: Array, sizes_g: Array, block_m: int
) -> tuple[Array, Array, Array]:
    """Copies of the inputs in which each group starts on a multiple of 8 rows.

    Group g keeps its rows in order, now from row starts_r[g] = sum over h < g of its size
    rounded up to 8; the rows between groups are zeros. A gather: deterministic.
    """
    num_rows, num_groups = lhs_mk.shape[0], sizes_g.shape[0]
    padded_g = (sizes_g + (_ROW_ALIGN - 1)) // _ROW_ALIGN * _ROW_ALIGN
    ends_r = jnp.cumsum(padded_g)
    starts_r = ends_r - padded_g
    # Static bound on sum(padded_g): at most 7 extra rows per group.
    num_out = -(-(num_rows + (_ROW_ALIGN - 1) * num_groups) // _ROW_ALIGN) * _ROW_ALIGN
    num_out = max(num_out, block_m)
    rows_r = jnp.arange(num_out, dtype=jnp.int32)
    group_r = jnp.minimum(jnp.searchsorted(ends_r, rows_r, side="right"), num_groups - 1)
    offset_r = rows_r - starts_r[group_r]
    in_group = (offset_r < sizes_g[group_r]) & (rows_r < ends_r[-1])
    # Rows outside every group read index num_rows: out of bounds, filled with zeros.
    source_r = jnp.where(in_group, starts_g[group_r] + offset_r, num_rows)
    take = functools.partial(jnp.take, indices=source_r, axis=0, mode="fill", fill_value=0)
    return take(lhs_mk), take(rhs_mn), starts_r.astype(jnp.int32)
