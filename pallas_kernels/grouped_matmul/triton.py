"""The forward grouped GEMM as a Triton-lowered `pl.pallas_call`: the portable fallback.

  out[m, :] = lhs[m, :] @ rhs[g(m)]      [M, K] x [G, K, N] (or [G, N, K]) -> [M, N]

For GPUs without sm90 (Mosaic GPU's wgmma/TMA kernel is the primary path). `reference.gmm` is
the spec. Pallas-Triton is deprecated in jax 0.11; lowering it warns (see `LOWERING_WARNING`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# jax 0.11 warns (DeprecationWarning) whenever it lowers a Pallas kernel through Triton. This file
# is the deliberate Triton fallback, so that one warning is expected here. It is raised when the
# call is lowered: inside `gmm` when called eagerly (ignored there), at the enclosing jit's
# lowering otherwise (tests that lower under jit ignore it with a scoped pytest mark).
LOWERING_WARNING = "The Pallas Triton backend is deprecated"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonTileConfig:
    """Tiles of the Triton `gmm`: one program computes [block_m rows, block_n columns].

    block_m, block_n, block_k: powers of two >= 16. num_warps and num_stages go to Triton.
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two <= 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")


def _row_tiles(group_sizes_g: Array, num_rows: int, block_m: int, num_tiles: int):
    """The programs' row tiles: each (group, block of block_m rows) pair that holds rows.

    Rows past sum(group_sizes) form one more group, G, whose rows are written as zeros.
    Returns int32 [num_tiles] arrays: group, first row, end row (empty for unused tiles).
    """
    num_groups = group_sizes_g.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes_g), num_rows)
    ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])  # + group G
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first_block = starts // block_m
    counts = jnp.where(ends > starts, (ends - 1) // block_m - first_block + 1, 0)
    tile_ends = jnp.cumsum(counts)
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_ends, tiles, side="right"), num_groups)
    block = first_block[group] + tiles - (tile_ends[group] - counts[group])
    lo = jnp.maximum(starts[group], block * block_m)
    hi = jnp.minimum(ends[group], (block + 1) * block_m)
    hi = jnp.where(tiles < tile_ends[-1], hi, lo)
    return group.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32)


def _gmm_kernel(
    group_ref,
    lo_ref,
    hi_ref,
    lhs_ref,
    rhs_ref,
    out_ref,
    *,
    block_m: int,
    block_k: int,
    num_groups: int,
    transpose_rhs: bool,
):
    """Program (t, j): rows [lo_t, hi_t) of group g_t (inside one block of block_m rows), columns
    block j.

    Invariants:
      1. The tiles partition the rows: each output row has exactly one writer per column block;
         rows of no group (group G) are written as zeros.
      2. K is reduced in order, in blocks of block_k, into an f32 accumulator; one cast at the
         store. Rows outside [lo, hi) are loaded as zeros and not stored.
    """
    num_k = lhs_ref.shape[1]
    g, lo, hi = group_ref[0], lo_ref[0], hi_ref[0]
    row0 = lo // block_m * block_m
    rows = row0 + jnp.arange(block_m, dtype=jnp.int32)
    row_ok = (rows >= lo) & (rows < hi)
    block_n = out_ref.shape[1]

    @pl.when((hi > lo) & (g < num_groups))
    def _matmul():
        def k_step(k, acc):
            ks = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
            a = pltr.load(lhs_ref.at[pl.ds(row0, block_m), ks], mask=row_ok[:, None], other=0.0)
            if transpose_rhs:
                b = rhs_ref[g, :, ks]  # [block_n, block_k]
                dims = (((1,), (1,)), ((), ()))
            else:
                b = rhs_ref[g, ks, :]  # [block_k, block_n]
                dims = (((1,), (0,)), ((), ()))
            return acc + lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, num_k // block_k, k_step, jnp.zeros((block_m, block_n), jnp.float32))
        pltr.store(
            out_ref.at[pl.ds(row0, block_m), :], acc.astype(out_ref.dtype), mask=row_ok[:, None]
        )

    @pl.when((hi > lo) & (g >= num_groups))
    def _no_group():
        zeros = jnp.zeros((block_m, block_n), out_ref.dtype)
        pltr.store(out_ref.at[pl.ds(row0, block_m), :], zeros, mask=row_ok[:, None])


def gmm(
    lhs_mk: Array,
    rhs_gkn: Array,
    group_sizes_g: Array,
    *,
    transpose_rhs: bool = False,
    config: TritonTileConfig | None = None,
    interpret: bool = False,
) -> Array:
    """[M, N] in lhs's dtype: each row times its group's matrix (see reference.gmm).

    lhs_mk: [M, K]; rhs_gkn: [G, K, N] ([G, N, K] with transpose_rhs), the same dtype (bf16, f16
    or f32); group_sizes_g: int32 [G]. K must be a multiple of config.block_k and N of
    config.block_n. Rows past sum(group_sizes_g) are zeros.
    """
    config = config or TritonTileConfig()
    if lhs_mk.ndim != 2 or rhs_gkn.ndim != 3:
        raise ValueError(f"lhs_mk {lhs_mk.shape} must be 2-D and rhs_gkn {rhs_gkn.shape} 3-D")
    if group_sizes_g.ndim != 1 or group_sizes_g.dtype != jnp.int32:
        raise ValueError(
            f"group_sizes_g must be int32 [G], got {group_sizes_g.dtype}{list(group_sizes_g.shape)}"
        )
    num_rows, num_k = lhs_mk.shape
    num_groups = rhs_gkn.shape[0]
    rhs_k, num_n = (rhs_gkn.shape[2], rhs_gkn.shape[1]) if transpose_rhs else rhs_gkn.shape[1:]
    if rhs_k != num_k:
        raise ValueError(f"lhs_mk K={num_k} != rhs K={rhs_k} ({transpose_rhs=})")
    if group_sizes_g.shape[0] != num_groups:
        raise ValueError(f"group_sizes_g has {group_sizes_g.shape[0]} groups, rhs {num_groups}")
    if lhs_mk.dtype != rhs_gkn.dtype or lhs_mk.dtype not in _DTYPES:
        raise ValueError(f"lhs_mk ({lhs_mk.dtype}) and rhs ({rhs_gkn.dtype}) must share a dtype")
    if num_k % config.block_k or num_n % config.block_n:
        raise ValueError(
            f"K={num_k} must be a multiple of block_k={config.block_k} and N={num_n} of "
            f"block_n={config.block_n}"
        )
    if num_rows == 0:
        return jnp.zeros((0, num_n), lhs_mk.dtype)

    block_m, block_n = config.block_m, config.block_n
    # Each group (and the rows of no group) adds at most one block to the row blocks of M.
    num_tiles = pl.cdiv(num_rows, block_m) + num_groups
    group_t, lo_t, hi_t = _row_tiles(group_sizes_g, num_rows, block_m, num_tiles)
    rhs_block = (num_groups, block_n, num_k) if transpose_rhs else (num_groups, num_k, block_n)
    rhs_index = (lambda t, j: (0, j, 0)) if transpose_rhs else (lambda t, j: (0, 0, j))
    tile_spec = pl.BlockSpec((1,), lambda t, j: (t,))
    call = pl.pallas_call(
        functools.partial(
            _gmm_kernel,
            block_m=block_m,
            block_k=config.block_k,
            num_groups=num_groups,
            transpose_rhs=transpose_rhs,
        ),
        out_shape=jax.ShapeDtypeStruct((num_rows, num_n), lhs_mk.dtype),
        grid=(num_tiles, num_n // block_n),
        in_specs=[
            tile_spec,
            tile_spec,
            tile_spec,
            pl.BlockSpec((num_rows, num_k), lambda t, j: (0, 0)),  # rows addressed in-kernel
            pl.BlockSpec(rhs_block, rhs_index),  # group addressed in-kernel
        ],
        out_specs=pl.BlockSpec((num_rows, block_n), lambda t, j: (0, j)),
        compiler_params=pltr.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
    )
    with warnings.catch_warnings():
        # Only jax's Triton-deprecation warning (see LOWERING_WARNING), and only here.
        warnings.filterwarnings("ignore", message=LOWERING_WARNING, category=DeprecationWarning)
        return call(group_t, lo_t, hi_t, lhs_mk, rhs_gkn)
