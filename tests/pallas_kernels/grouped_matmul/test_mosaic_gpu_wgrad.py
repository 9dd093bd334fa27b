"""tgmm, the Mosaic GPU weight-gradient kernel: its output parts, the per-group row-block table
and its one-unit-ahead loads, bits that depend on a group's start only modulo 8 and not on the
CTA count or the tile order, race checks, clusters, rows outside the groups, input validation
and bank-conflict-free epilogue stores, under GPU interpret mode on CPU, with GPU-marked twins.
Its contracts (lowering for CUDA, reference.tgmm's values in interpret mode and on a GPU) are
rows of tests/pallas_kernels/test_contracts.py, with this file's tiles and TOLERANCE."""

from __future__ import annotations

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import mosaic_gpu_wgrad, reference, tuning
from pallas_kernels.grouped_matmul.mosaic_gpu_wgrad import tgmm
from pallas_kernels.grouped_matmul.tuning import TileConfig

# f32 accumulation of bf16 products (exact in f32) over at most a few thousand rows: the error
# is f32 rounding, relative to the output's scale. tgmm's table, tighter than the tolerance
# table's (pallas_kernels/tolerances.py) f32 bound; test_contracts.py holds tgmm to it too.
TOLERANCE = {jnp.float32: 2e-6, jnp.bfloat16: 2**-8, jnp.float16: 2**-10}

# Small tiles so that interpret mode exercises several units, both consumers, partial tiles.
SMALL = TileConfig(
    block_m=64,
    block_n=128,
    block_k=64,
    max_concurrent_steps=2,
    delay_release=0,
    epi_block_m=64,
    epi_block_n=32,
)
SMALL_ONE_CONSUMER = TileConfig(
    block_m=64, block_n=64, block_k=64, max_concurrent_steps=3, delay_release=0, num_consumers=1
)
# One wgmma in flight, each stage released a step later (invariant 5).
SMALL_DELAYED = dataclasses.replace(SMALL, delay_release=1)
# Cases of more than a few seconds on 2 CPU cores: the fast tier (./test.sh) leaves them out.
SLOW = pytest.mark.slow
H200 = jax.sharding.AbstractMesh(
    (1,),
    ("x",),
    abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"
    ),
)


def _inputs(seed: int, num_rows: int, num_k: int, num_n: int, dtype=jnp.bfloat16):
    lhs_key, rhs_key = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(lhs_key, (num_rows, num_k), jnp.float32).astype(dtype)
    rhs = jax.random.normal(rhs_key, (num_rows, num_n), jnp.float32).astype(dtype)
    return lhs, rhs


def _assert_matches_reference(out, lhs, rhs, group_sizes, out_dtype=jnp.float32):
    expected = reference.tgmm(lhs, rhs, group_sizes)
    chex.assert_shape(out, expected.shape)
    chex.assert_type(out, out_dtype)
    scale = float(jnp.max(jnp.abs(expected))) or 1.0
    tol = TOLERANCE[out_dtype]
    chex.assert_trees_all_close(out.astype(jnp.float32), expected, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(SMALL, id="two", marks=SLOW),
        pytest.param(SMALL_ONE_CONSUMER, id="one_consumer"),
    ],
)
@pytest.mark.parametrize("out_parts", [2, pytest.param(3, marks=SLOW)])
def test_output_parts_are_the_single_outputs_columns_bits(out_parts, config):
    """Invariant 8: out_parts splits the product's columns between arrays, bit for bit."""
    num_n = out_parts * config.block_n
    lhs, rhs = _inputs(4, 203, 128, num_n)
    group_sizes = jnp.asarray([17, 45, 0, 3, 70, 31, 37], jnp.int32)
    whole = tgmm(lhs, rhs, group_sizes, config=config, interpret=True)
    parts = tgmm(lhs, rhs, group_sizes, config=config, out_parts=out_parts, interpret=True)
    assert isinstance(parts, tuple) and len(parts) == out_parts
    chex.assert_trees_all_equal(parts, tuple(jnp.split(whole, out_parts, axis=2)))
    _assert_matches_reference(whole, lhs, rhs, group_sizes)


def test_output_parts_of_no_rows_are_zeros_and_bad_parts_raise():
    lhs, rhs = _inputs(5, 64, 64, 256)
    parts = tgmm(lhs, rhs, jnp.zeros((2,), jnp.int32), out_parts=2, interpret=True)
    chex.assert_trees_all_equal(parts, (jnp.zeros((2, 64, 128), jnp.float32),) * 2)
    empty = tgmm(lhs[:0], rhs[:0], jnp.zeros((2,), jnp.int32), out_parts=2, interpret=True)
    chex.assert_trees_all_equal(empty, (jnp.zeros((2, 64, 128), jnp.float32),) * 2)
    sizes = jnp.asarray([64], jnp.int32)
    with pytest.raises(ValueError, match="out_parts=3 must be a positive int dividing N=256"):
        tgmm(lhs, rhs, sizes, out_parts=3, interpret=True)
    with pytest.raises(ValueError, match="out_parts=0 must be a positive int"):
        tgmm(lhs, rhs, sizes, out_parts=0, interpret=True)
    with pytest.raises(ValueError, match="each of the 4 output parts holds N=64 columns"):
        tgmm(lhs, rhs, sizes, config=SMALL, out_parts=4, interpret=True)


def test_default_config_under_jit():
    lhs, rhs = _inputs(4, 300, 128, 256)
    group_sizes = jnp.asarray([100, 0, 150], jnp.int32)
    out = jax.jit(lambda a, b, s: tgmm(a, b, s, interpret=True))(lhs, rhs, group_sizes)
    _assert_matches_reference(out, lhs, rhs, group_sizes)


def test_row_blocks_table():
    """row_blocks against a per-group loop: groups clipped at M, empty groups, starts that are
    and are not multiples of 8, a group that ends exactly at a block's end."""
    num_rows, block_rows = 203, 64
    sizes = [17, 45, 0, 3, 63, 6, 0, 40, 100, 5]  # sum > M: the last two groups are clipped
    table = np.asarray(
        mosaic_gpu_wgrad.row_blocks(
            jnp.asarray(sizes, jnp.int32), num_rows=num_rows, block_rows=block_rows
        )
    )
    start = 0
    for g, size in enumerate(sizes):
        size = max(min(size, num_rows - start), 0)
        base, lead = start - start % 8, start % 8
        if size:
            num_blocks = -(-(lead + size) // block_rows)
            tail_end = lead + size - (num_blocks - 1) * block_rows
            assert 0 < tail_end <= block_rows
            expected = [base, lead, num_blocks, tail_end]
        else:
            expected = [base, lead, 0, 0]
        assert table[g].tolist() == expected, (g, table[g], expected)
        start += size
    assert table.dtype == np.int32 and table.shape == (len(sizes), 4)
    # Group 4 (rows 65..127, lead 1) fills its single block: tail_end = block_rows. Group 9
    # starts at M: clipped to no row.
    assert table[4].tolist() == [64, 1, 1, 64]
    assert table[9].tolist() == [200, 3, 0, 0]


# Many small groups of different sizes (empty ones among them, neighbours of equal size only
# where both are empty): each unit reads its own group's row of the table, which the kernel
# loads one unit ahead.
_MANY_GROUPS = [5, 0, 17, 64, 0, 3, 70, 9, 0, 0, 31, 130, 1]


@pytest.mark.slow
def test_each_unit_gets_its_own_groups_scalars():
    """13 groups of 2 units each (N = 2 tiles) over 1, 3 and 4 CTAs: 26 units, so a CTA's
    next unit (unit + CTA count, whose scalars it loads during the current unit) lies in the
    same group (1 CTA) or in another, at varying distances, and the CTAs' last units are in
    different groups. Scalars of any other unit than the current one give another group's row
    count, first row or tail, and a wrong result; every CTA count gives the same bits."""
    lhs, rhs = _inputs(14, 340, 64, 256)
    group_sizes = jnp.asarray(_MANY_GROUPS, jnp.int32)
    one_cta, *others = (
        tgmm(
            lhs,
            rhs,
            group_sizes,
            config=dataclasses.replace(SMALL, grid_size=grid_size),
            interpret=True,
        )
        for grid_size in (1, 3, 4)
    )
    _assert_matches_reference(one_cta, lhs, rhs, group_sizes)
    for out in others:
        chex.assert_trees_all_equal(out, one_cta)


def test_more_ctas_than_units():
    """3 units over 5 CTAs: two CTAs have no unit (their first load reads the last group and
    goes unused; their warpgroups exit at once)."""
    lhs, rhs = _inputs(15, 40, 64, 128)
    group_sizes = jnp.asarray([7, 0, 30], jnp.int32)
    out = tgmm(
        lhs, rhs, group_sizes, config=dataclasses.replace(SMALL, grid_size=5), interpret=True
    )
    _assert_matches_reference(out, lhs, rhs, group_sizes)


@pytest.mark.parametrize("delay_release", [0, 1])
def test_no_races_between_warpgroups(delay_release):
    """Invariants 5 and 6 under the interpreter's race detector: the memory warpgroup refills a
    stage only after both compute warpgroups released it. Two stages, units of 0 to 3 row
    blocks (the rhs masked in first and last blocks), 8 units over 2 CTAs: the ring wraps
    inside units and across their boundaries, and past units of an empty group."""
    # The interpreter's race detector prints; its private state says whether it found one.
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    lhs, rhs = _inputs(5, 200, 128, 128)
    group_sizes = jnp.asarray([60, 0, 130, 10], jnp.int32)
    params = plgpu.InterpretGPUParams(detect_races=True)
    config = dataclasses.replace(SMALL, delay_release=delay_release)
    out = tgmm(lhs, rhs, group_sizes, config=config, interpret=params)
    jax.block_until_ready(out)
    assert not gpu_callbacks.get_races().races_found
    _assert_matches_reference(out, lhs, rhs, group_sizes)


@pytest.mark.slow
@pytest.mark.parametrize("delay_release", [0, 1])
def test_clusters_of_two_k_tiles_give_the_same_bits(delay_release):
    """Invariant 7 under the race detector: cluster_m = 2 pairs K tiles 2j, 2j + 1 of one
    (group, N tile) on two CTAs, each rhs block multicast into both and masked in each copy;
    the reference's values and bitwise the single-CTA output, with an empty group, groups
    starting inside an 8-row tile, units of 1 to 3 row blocks, and rows of no group. The
    interpreter does not model multicast (each CTA copies its own source): this holds the
    arrivals, phases and tile mapping; the GPU twin holds the cross-CTA writes."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    lhs, rhs = _inputs(6, 203, 256, 256)
    group_sizes = jnp.asarray([60, 0, 93, 3, 30], jnp.int32)
    single = dataclasses.replace(SMALL, delay_release=delay_release, grid_size=4)
    paired = dataclasses.replace(single, cluster_m=2)
    params = plgpu.InterpretGPUParams(detect_races=True)
    out = jax.block_until_ready(tgmm(lhs, rhs, group_sizes, config=paired, interpret=params))
    assert not gpu_callbacks.get_races().races_found
    _assert_matches_reference(out, lhs, rhs, group_sizes)
    chex.assert_trees_all_equal(out, tgmm(lhs, rhs, group_sizes, config=single, interpret=True))


@pytest.mark.parametrize(
    ("units_k", "units_n", "minor", "width"),
    [
        (5, 3, "n", 1),  # K tiles fastest
        (5, 3, "m", 2),  # bands of 2 K tiles, the last band of 1
        (5, 3, "m", 3),  # a width not a power of 2 (planar_snake's branchless path)
        (5, 3, "m", 16),  # one band wider than K: K tiles fastest within each N tile
        (4, 6, "n", 4),  # bands of N tiles
        (1, 1, "m", 16),  # one tile a group
    ],
)
def test_unit_tile_is_a_group_major_bijection(units_k, units_n, minor, width):
    """unit_tile sends the units onto every (g, k tile, n tile) exactly once (one writer per
    output tile), all of group g's units before g + 1's, in bands of `width` tiles along the
    chosen dimension."""
    num_groups = 3
    per_group = units_k * units_n
    config = dataclasses.replace(SMALL, grid_minor_dim=minor, grid_tile_width=width)
    tiles = jax.jit(
        jax.vmap(
            lambda u: mosaic_gpu_wgrad.unit_tile(u, units_k=units_k, units_n=units_n, config=config)
        )
    )(jnp.arange(num_groups * per_group, dtype=jnp.int32))
    g, k, n = (np.asarray(t) for t in tiles)
    np.testing.assert_array_equal(g, np.repeat(np.arange(num_groups), per_group))
    assert sorted(zip(g.tolist(), k.tolist(), n.tolist(), strict=True)) == [
        (gi, ki, ni) for gi in range(num_groups) for ki in range(units_k) for ni in range(units_n)
    ]
    # Bands: the band index (along the minor dimension) never decreases within a group, and
    # a band holds `width` minor tiles times every major tile.
    minor_idx = (k if minor == "m" else n)[:per_group]
    band = minor_idx // width
    assert np.all(np.diff(band) >= 0)
    major_size = units_n if minor == "m" else units_k
    full_bands = (units_k if minor == "m" else units_n) // width
    np.testing.assert_array_equal(
        np.bincount(band)[:full_bands], np.full(full_bands, width * major_size)
    )


def test_wide_n_bands_are_the_n_fastest_order():
    """grid_minor_dim="n" with a band as wide as N is the row-major (k, n) order."""
    config = dataclasses.replace(SMALL, grid_minor_dim="n", grid_tile_width=8)
    units = jnp.arange(2 * 3 * 8, dtype=jnp.int32)
    g, k, n = jax.vmap(
        lambda u: mosaic_gpu_wgrad.unit_tile(u, units_k=3, units_n=8, config=config)
    )(units)
    np.testing.assert_array_equal(g, units // 24)
    np.testing.assert_array_equal(k, units % 24 // 8)
    np.testing.assert_array_equal(n, units % 8)


@pytest.mark.slow
def test_tile_order_and_release_delay_do_not_change_bits():
    """The tile order only decides which CTA computes a tile (3 CTAs here, 36 units), and
    delay_release only when a stage is released: every order and delay gives the same bits,
    and they match the reference."""
    lhs, rhs = _inputs(13, 150, 256, 384)
    group_sizes = jnp.asarray([53, 0, 70, 27], jnp.int32)
    outs = {
        (minor, width, delay): tgmm(
            lhs,
            rhs,
            group_sizes,
            config=dataclasses.replace(
                SMALL,
                grid_minor_dim=minor,
                grid_tile_width=width,
                grid_size=3,
                delay_release=delay,
            ),
            interpret=True,
        )
        for minor, width, delay in [("n", 3, 0), ("m", 2, 0), ("n", 1, 0), ("m", 2, 1)]
    }
    (base, *others) = outs.values()
    for other in others:
        chex.assert_trees_all_equal(other, base)
    _assert_matches_reference(base, lhs, rhs, group_sizes)


@pytest.mark.slow
@pytest.mark.parametrize(("prepend", "same_bits_as"), [(16, 0), (13, 5)])
def test_result_depends_on_the_start_only_modulo_8(prepend, same_bits_as):
    """A leading group of `prepend` rows moves every other group; each keeps its bits when the
    move is the same modulo 8 (invariant 2): by a multiple of 8 rows they are the unshifted
    groups' bits; 13 rows and 5 rows give the same bits (and both match the reference)."""
    lhs, rhs = _inputs(6, 192, 64, 128)
    sizes = [64, 0, 69, 43]

    def run(shift):
        extra_lhs, extra_rhs = _inputs(7, shift, 64, 128)
        out = tgmm(
            jnp.concatenate([extra_lhs, lhs]),
            jnp.concatenate([extra_rhs, rhs]),
            jnp.asarray([shift, *sizes], jnp.int32),
            config=SMALL,
            interpret=True,
        )
        return out[1:]

    if same_bits_as == 0:
        base = tgmm(lhs, rhs, jnp.asarray(sizes, jnp.int32), config=SMALL, interpret=True)
    else:
        base = run(same_bits_as)
    shifted = run(prepend)
    chex.assert_trees_all_equal(shifted, base)
    _assert_matches_reference(shifted, lhs, rhs, jnp.asarray(sizes, jnp.int32))


def test_rows_outside_groups_do_not_leak():
    """Every row outside group 1 (its neighbours in the same 8-row tiles and row blocks, and
    the rows of no group) holds huge values; group 1's result must not see them."""
    lhs, rhs = _inputs(8, 130, 64, 128)
    group_sizes = jnp.asarray([3, 101, 2], jnp.int32)
    outside = (reference.group_ids(group_sizes, 130) != 1)[:, None]
    loud = jnp.asarray(1e4, jnp.bfloat16)
    out = tgmm(
        jnp.where(outside, loud, lhs),
        jnp.where(outside, -loud, rhs),
        group_sizes,
        config=SMALL,
        interpret=True,
    )
    expected = reference.tgmm(lhs, rhs, group_sizes)[1]
    tol = TOLERANCE[jnp.float32]
    scale = float(jnp.max(jnp.abs(expected)))
    chex.assert_trees_all_close(out[1], expected, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize(
    ("lhs_shape", "rhs_shape", "dtype", "sizes_dtype", "message"),
    [
        ((64, 96), (64, 128), jnp.bfloat16, jnp.int32, "K=96 and N=128 must be"),
        ((64, 64), (64, 100), jnp.bfloat16, jnp.int32, "K=64 and N=100 must be"),
        ((64, 64), (65, 64), jnp.bfloat16, jnp.int32, "lhs_mk rows 64 != rhs_mn rows 65"),
        ((64, 64), (64, 64), jnp.float32, jnp.int32, "must both be bfloat16 or float16"),
        ((64, 64), (64, 64), jnp.bfloat16, jnp.float32, "group_sizes_g must be int32"),
        ((64,), (64, 64), jnp.bfloat16, jnp.int32, "must be 2-D"),
    ],
)
def test_bad_inputs_raise(lhs_shape, rhs_shape, dtype, sizes_dtype, message):
    lhs = jnp.zeros(lhs_shape, dtype)
    rhs = jnp.zeros(rhs_shape, dtype)
    with pytest.raises(ValueError, match=re.escape(message)):
        tgmm(lhs, rhs, jnp.ones((2,), sizes_dtype), interpret=True)


def test_bad_out_dtype_and_config_raise():
    lhs, rhs = jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.bfloat16)
    sizes = jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="out_dtype=dtype\\('int32'\\) must be"):
        tgmm(lhs, rhs, sizes, out_dtype=jnp.int32, interpret=True)
    rows_split = TileConfig(block_m=128, block_n=128, consumer_dim="m")
    with pytest.raises(ValueError, match="consumer_dim must be 'n', got 'm'"):
        tgmm(lhs, rhs, sizes, config=rows_split, interpret=True)
    with pytest.raises(ValueError, match="cluster_n must be 1, got 2"):
        tgmm(lhs, rhs, sizes, config=dataclasses.replace(SMALL, cluster_n=2), interpret=True)
    with pytest.raises(ValueError, match="K=64 / block_m=64 must give an even number of tiles"):
        tgmm(lhs, rhs, sizes, config=dataclasses.replace(SMALL, cluster_m=2), interpret=True)
    narrow_epilogue = dataclasses.replace(SMALL, epi_block_n=8)
    with pytest.raises(ValueError, match="epi_block_n=8 bfloat16 values is 16 bytes"):
        tgmm(lhs, rhs, sizes, config=narrow_epilogue, out_dtype=jnp.bfloat16, interpret=True)


@pytest.mark.parametrize(("num_k", "num_n"), [(2048, 1536), (768, 2048), (64, 64), (192, 320)])
def test_default_config_fits_the_shape(num_k, num_n):
    config = mosaic_gpu_wgrad.default_config(num_k, num_n)
    assert config.delay_release == tuning.default_config("tgmm").delay_release
    assert num_k % config.block_m == 0 and num_n % config.block_n == 0
    mosaic_gpu_wgrad.check_config(config)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("num_k", "num_n", "config"), [(4096, 28672, None), (128, 256, SMALL)])
def test_smem_transfers_are_bank_conflict_free(monkeypatch, out_dtype, num_k, num_n, config):
    """Every register <-> SMEM transfer (the epilogue's stores into the swizzled out_smem, the
    masked rhs rows) lowers to a transfer that Mosaic GPU planned free of bank conflicts.
    Mosaic GPU falls back silently to an unplanned (optimized=False) transfer when it finds no
    such plan: this spies on FragmentedArray (jax.experimental.mosaic.gpu) for that."""
    from jax.experimental.mosaic.gpu import fragmented_array

    transfers = []
    array_cls = fragmented_array.FragmentedArray
    store_tiled, load_tiled = array_cls.store_tiled, array_cls.load_tiled.__func__

    def spy_store(self, ref, swizzle, optimized=True, **kwargs):
        transfers.append(("store", self.shape, str(self.mlir_dtype), optimized))
        return store_tiled(self, ref, swizzle, optimized, **kwargs)

    def spy_load(cls, ref, swizzle, *, optimized=True, **kwargs):
        transfers.append(("load", optimized))
        return load_tiled(cls, ref, swizzle, optimized=optimized, **kwargs)

    monkeypatch.setattr(array_cls, "store_tiled", spy_store)
    monkeypatch.setattr(array_cls, "load_tiled", classmethod(spy_load))
    args = (
        jax.ShapeDtypeStruct((4096, num_k), jnp.bfloat16),
        jax.ShapeDtypeStruct((4096, num_n), jnp.bfloat16),
        jax.ShapeDtypeStruct((8,), jnp.int32),
    )
    with jax.sharding.use_abstract_mesh(H200):
        jax.jit(lambda a, b, s: tgmm(a, b, s, config=config, out_dtype=out_dtype)).trace(
            *args
        ).lower(lowering_platforms=("cuda",))
    epilogue = (config or mosaic_gpu_wgrad.default_config(num_k, num_n)).epilogue_tile
    out_name = "f32" if out_dtype == jnp.float32 else "bf16"
    assert ("store", epilogue, out_name, True) in transfers, transfers
    assert all(transfer[-1] for transfer in transfers), transfers


# GPU twins at real size (skipped without a GPU).


def _uniform_sizes(num_rows: int, num_groups: int, seed: int, align: int = 1) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(0, num_groups, num_rows)
    return (np.bincount(ids, minlength=num_groups) // align * align).astype(np.int32)


@pytest.mark.gpu
def test_gpu_bits_depend_on_the_start_only_modulo_8():
    lhs, rhs = _inputs(10, 16384, 512, 768)
    sizes = _uniform_sizes(15384, 16, seed=2)
    run = jax.jit(lambda a, b, s: tgmm(a, b, s))

    def shifted(prepend):
        extra_lhs, extra_rhs = _inputs(11, prepend, 512, 768)
        return run(
            jnp.concatenate([extra_lhs, lhs])[:16384],
            jnp.concatenate([extra_rhs, rhs])[:16384],
            jnp.asarray(np.concatenate([[prepend], sizes]).astype(np.int32)),
        )[1:]

    chex.assert_trees_all_equal(shifted(16), run(lhs, rhs, jnp.asarray(sizes)))
    chex.assert_trees_all_equal(shifted(13), shifted(5))


@pytest.mark.gpu
def test_gpu_clusters_of_two_k_tiles_give_the_single_cta_bits():
    """Invariant 7 on the hardware at qwen3 gate_up's size: cluster_m = 2 (the rhs row blocks
    multicast) gives the single-CTA bits."""
    num_rows, num_k, num_n, num_groups = 131072, 2048, 1536, 128
    lhs, rhs = _inputs(13, num_rows, num_k, num_n)
    sizes = jnp.asarray(_uniform_sizes(num_rows - 77, num_groups, seed=4))
    single = mosaic_gpu_wgrad.default_config(num_k, num_n)
    paired = dataclasses.replace(single, cluster_m=2)

    def run(config):
        return jax.jit(lambda a, b, s: tgmm(a, b, s, config=config))(lhs, rhs, sizes)

    chex.assert_trees_all_equal(run(paired), run(single))
