"""The Mosaic GPU grouped matmuls' own properties: the fused SwiGLU backward's races and empty
calls, an rhs in parts along K, the default tiles' pipelines, rows split between consumers,
clusters, the warpgroups' race checks, bits independent of where a group starts, the schedule,
bad inputs; GPU interpret mode on CPU (small tiles), with GPU-marked twins at real sizes. Each
kernel's contracts (lowering for CUDA, the reference's result in interpret mode and on a GPU)
are rows of tests/pallas_kernels/test_contracts.py, which runs them with this file's CASES,
tiles and `swiglu_bwd_parts`."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import mosaic_gpu, reference, tuning
from pallas_kernels.grouped_matmul.tuning import TileConfig
from pallas_kernels.tolerances import tolerance

# Small tiles keep GPU interpret mode fast on 2 CPU cores; 3 programs exercise the persistent
# loop (several tiles per program) and the partial last wave: the table's interpret config.
SMALL = tuning.INTERPRET_CONFIG
# Cases of more than a few seconds on 2 CPU cores: the fast tier (./test.sh) leaves them out.
SLOW = pytest.mark.slow

# (M, K, N, group sizes): empty groups, partial tiles, sum < M, sum > M (clamped), G = 1 with a
# single group holding every row, M = 1, M not a multiple of anything.
CASES = [
    (200, 128, 128, (70, 0, 100)),
    (37, 64, 128, (37,)),
    (1, 64, 128, (0, 1, 0)),
    (131, 128, 256, (3, 60, 2, 1, 64)),
    (50, 64, 128, (30, 40)),
]


def _inputs(m, k, n, sizes, *, dtype=jnp.bfloat16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    g = len(sizes)
    lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    rhs = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / 4).astype(dtype)
    scale = jax.random.uniform(keys[2], (m,), jnp.float32, 0.5, 1.5)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), scale, keys[3]


def _assert_close(actual, expected, stored):
    """f32 accumulation of the same rounded inputs: f32-tight; a 16-bit output: its rounding."""
    tol = tolerance(jnp.float32, stored)
    expected = jnp.asarray(expected, jnp.float32)
    chex.assert_trees_all_close(
        jnp.asarray(actual, jnp.float32),
        expected,
        rtol=tol.rtol,
        atol=tol.scaled_atol(expected),
    )


def _rows_past_groups(sizes, m):
    return slice(min(int(np.sum(sizes)), m), m)


def _swiglu_bwd_inputs(m, k, n, sizes, seed=0):
    """lhs [M, K], dy [M, K], w_gate, w_up [G, K, N], w_down [G, N, K], sizes, row scale."""
    lhs, w_gate, group_sizes, scale, key = _inputs(m, k, n, sizes, seed=seed)
    keys = jax.random.split(key, 3)
    w_up = (jax.random.normal(keys[0], w_gate.shape, jnp.float32) / 4).astype(lhs.dtype)
    w_down = (jax.random.normal(keys[1], (len(sizes), n, k), jnp.float32) / 4).astype(lhs.dtype)
    dy = jax.random.normal(keys[2], (m, k), jnp.float32).astype(lhs.dtype)
    return lhs, dy, w_gate, w_up, w_down, group_sizes, scale


def swiglu_bwd_parts(lhs, dy, w_gate, w_up, w_down, group_sizes, scale, run):
    """What gmm_swiglu_bwd fuses, from the unfused kernels (called with `run`: config and
    interpret) and XLA: h, [d_gate | d_up] and d_s (None without a scale); invariant 10 says
    h is gmm_swiglu's bits, the others the unfused f32 formulas' values to their rounding."""
    h = mosaic_gpu.gmm_swiglu(lhs, w_gate, w_up, group_sizes, **run)
    gate, up = (
        mosaic_gpu.gmm(lhs, w, group_sizes, out_dtype=jnp.float32, **run) for w in (w_gate, w_up)
    )
    g = mosaic_gpu.gmm(dy, w_down, group_sizes, transpose_rhs=True, out_dtype=jnp.float32, **run)
    dh = g if scale is None else g * scale[:, None]
    sig = jax.nn.sigmoid(gate)
    d_gate = dh * up * (sig * (1.0 + gate * (1.0 - sig)))
    d_up = dh * gate * sig
    d_s = None if scale is None else jnp.sum(h.astype(jnp.float32) * g, axis=1)
    return h, jnp.concatenate([d_gate, d_up], axis=1), d_s


@pytest.mark.slow
@pytest.mark.parametrize("consumer_dim", ["n", "m"])
def test_gmm_swiglu_bwd_has_no_races_and_owns_each_partial_once(consumer_dim):
    """Invariant 10 under the race detector: two lhs and three rhs tiles a stage; each
    consumer's d_s partials go to their own slots (a consumer writing another's would make d_s
    wrong at split "n", where both hold all rows, or at "m", where each holds half)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    m, k, n, sizes = 300, 192, 256, (70, 0, 100, 3, 64)
    lhs, dy, w_gate, w_up, w_down, group_sizes, scale = _swiglu_bwd_inputs(m, k, n, sizes, seed=1)
    config = dataclasses.replace(
        SMALL, block_m=128, block_n=128, max_concurrent_steps=2, consumer_dim=consumer_dim
    )
    params = plgpu.InterpretGPUParams(detect_races=True)
    outs = mosaic_gpu.gmm_swiglu_bwd(
        lhs,
        dy,
        w_gate,
        w_up,
        w_down,
        group_sizes,
        row_scale_m=scale,
        config=config,
        interpret=params,
    )
    jax.block_until_ready(outs)
    assert not gpu_callbacks.get_races().races_found
    parts = swiglu_bwd_parts(
        lhs, dy, w_gate, w_up, w_down, group_sizes, scale, dict(config=SMALL, interpret=True)
    )
    chex.assert_trees_all_equal(outs[0], parts[0])
    _assert_close(outs[1], parts[1], jnp.bfloat16)
    _assert_close(outs[2], parts[2], jnp.float32)


def test_gmm_swiglu_bwd_of_no_rows():
    lhs, dy, w_gate, w_up, w_down, _, scale = _swiglu_bwd_inputs(8, 64, 128, (8,))
    h, d_gate_up, d_s = mosaic_gpu.gmm_swiglu_bwd(
        lhs[:0],
        dy[:0],
        w_gate,
        w_up,
        w_down,
        jnp.array([0], jnp.int32),
        row_scale_m=scale[:0],
        config=SMALL,
        interpret=True,
    )
    chex.assert_shape((h, d_gate_up, d_s), ((0, 128), (0, 256), (0,)))


@pytest.mark.slow
@pytest.mark.parametrize("num_parts", [2, 3])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["forward", "dgrad"])
def test_rhs_parts_give_the_bits_of_the_concatenated_rhs(transpose_rhs, num_parts):
    """Invariant 9: an rhs in parts along K gives the concatenated rhs's bits (with a row scale
    too); a part swap gives other values, so the test sees which part a K step reads."""
    m, part_k, n, sizes = 131, 128, 128, (3, 60, 2, 1, 64)
    lhs, _, group_sizes, scale, key = _inputs(m, part_k * num_parts, n, sizes)
    shape = (len(sizes), n, part_k) if transpose_rhs else (len(sizes), part_k, n)
    keys = jax.random.split(key, num_parts)
    parts = tuple(jax.random.normal(k, shape, jnp.float32).astype(lhs.dtype) for k in keys)
    whole = jnp.concatenate(parts, axis=2 if transpose_rhs else 1)
    run = dict(transpose_rhs=transpose_rhs, config=SMALL, interpret=True)
    out = mosaic_gpu.gmm(lhs, parts, group_sizes, **run)
    chex.assert_trees_all_equal(out, mosaic_gpu.gmm(lhs, whole, group_sizes, **run))
    if not transpose_rhs:
        scaled = dict(run, row_scale_m=scale, out_dtype=jnp.float32)
        chex.assert_trees_all_equal(
            mosaic_gpu.gmm(lhs, parts, group_sizes, **scaled),
            mosaic_gpu.gmm(lhs, whole, group_sizes, **scaled),
        )
    swapped = mosaic_gpu.gmm(lhs, parts[::-1], group_sizes, **run)
    assert not np.array_equal(np.asarray(swapped), np.asarray(out))


# Whole 64-row groups with many empty ones: every program runs several matmul tiles back to back.
def _gmm_or_swiglu(product, lhs, w_gate, w_up, group_sizes, config, interpret):
    """(kernel output, reference) of gmm(lhs, w_gate) or gmm_swiglu(lhs, w_gate, w_up)."""
    if product == "swiglu":
        out = mosaic_gpu.gmm_swiglu(
            lhs, w_gate, w_up, group_sizes, config=config, interpret=interpret
        )
        return out, reference.gmm_swiglu(lhs, w_gate, w_up, group_sizes)
    out = mosaic_gpu.gmm(lhs, w_gate, group_sizes, config=config, interpret=interpret)
    return out, reference.gmm(lhs, w_gate, group_sizes)


_BACK_TO_BACK_SIZES = (64, 0, 128, 0, 0, 64, 0, 128, 0, 64, 0, 0)


@pytest.mark.parametrize("source", [pytest.param("gpu_default", marks=SLOW), "interpret_default"])
@pytest.mark.parametrize("product", ["gmm", "swiglu"])
def test_default_configs_survive_single_k_step_tiles(product, source):
    """Invariant 5: the default configs (delay_release=1) under the interpreter's barrier checks.

    With K = block_k a tile's pipeline has one step, which delay_release=1 never releases: the
    producer once ran tiles ahead of the consumers (a barrier phase they missed) and refilled
    stages still being read. The GPU table's config runs with its pipeline unchanged (stages,
    delay_release, consumers, tiles); only its grid is cut to 3 programs to keep this fast.
    """
    m, k, n = 512, 64, 256  # K = block_k: one K step per tile; N: gmm's GPU block_n
    lhs, w_gate, group_sizes, _, key = _inputs(m, k, n, _BACK_TO_BACK_SIZES)
    w_up = (jax.random.normal(key, w_gate.shape, jnp.float32) / 4).astype(jnp.bfloat16)
    shape_class = "gmm_swiglu" if product == "swiglu" else "gmm"
    if source == "gpu_default":
        gpu = tuning.default_config(shape_class)
        assert gpu.delay_release == 1
        config = dataclasses.replace(gpu, grid_size=3)
    else:
        config = None  # the interpret table's config, also delay_release=1
    out, expected = _gmm_or_swiglu(product, lhs, w_gate, w_up, group_sizes, config, True)
    _assert_close(out, expected, jnp.bfloat16)
    past = _rows_past_groups(_BACK_TO_BACK_SIZES, m)
    chex.assert_trees_all_equal(out[past], jnp.zeros_like(out)[past])


@pytest.mark.parametrize(
    "product",
    [pytest.param("gmm", marks=SLOW), "dgrad", "scaled_f32", pytest.param("swiglu", marks=SLOW)],
)
def test_consumers_splitting_rows_match_reference(product):
    """consumer_dim "m": each consumer owns half of a tile's rows (all its columns); partial
    and empty groups, rows past the groups, row boundaries inside a consumer's half."""
    m, k, n = 300, 128, 128
    sizes = (70, 0, 100, 3, 64)
    lhs, rhs, group_sizes, scale, key = _inputs(m, k, n, sizes)
    config = dataclasses.replace(SMALL, block_m=128, consumer_dim="m")
    if product == "swiglu":
        w_up = (jax.random.normal(key, rhs.shape, jnp.float32) / 4).astype(jnp.bfloat16)
        out = mosaic_gpu.gmm_swiglu(lhs, rhs, w_up, group_sizes, config=config, interpret=True)
        expected, stored = reference.gmm_swiglu(lhs, rhs, w_up, group_sizes), jnp.bfloat16
    elif product == "dgrad":
        out = mosaic_gpu.gmm(
            lhs, rhs, group_sizes, transpose_rhs=True, config=config, interpret=True
        )
        expected = reference.gmm(lhs, rhs, group_sizes, transpose_rhs=True)
        stored = jnp.bfloat16
    elif product == "scaled_f32":
        out = mosaic_gpu.gmm(
            lhs,
            rhs,
            group_sizes,
            row_scale_m=scale,
            out_dtype=jnp.float32,
            config=config,
            interpret=True,
        )
        expected = reference.gmm(lhs, rhs, group_sizes) * scale[:, None]
        stored = jnp.float32
    else:
        out = mosaic_gpu.gmm(lhs, rhs, group_sizes, config=config, interpret=True)
        expected, stored = reference.gmm(lhs, rhs, group_sizes), jnp.bfloat16
    _assert_close(out, expected, stored)
    past = _rows_past_groups(sizes, m)
    chex.assert_trees_all_equal(out[past], jnp.zeros_like(out)[past])


CLUSTERS = {
    "cluster_n": {"cluster_n": 2},
    "cluster_m": {"cluster_m": 2},
    "cluster_2x2": {"cluster_m": 2, "cluster_n": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("cluster", list(CLUSTERS))
@pytest.mark.parametrize("product", ["gmm", "dgrad", "swiglu"])
def test_clusters_give_the_same_bits(product, cluster):
    """Invariant 7: clusters of CTAs, the lhs tile (cluster_n), the rhs tile (cluster_m) or
    both (2 x 2) multicast, under the race detector: the reference's values, and bitwise the
    single-CTA kernel's output (each tile runs the same K steps in the same order wherever it
    is computed). The groups give cluster_m pairs whose second half has no rows of the group,
    and, at the end of M, one wholly past lhs's rows. The interpreter does not model multicast
    (each CTA copies its own source): this holds the arrivals, phases and tile mapping; the
    GPU twin holds the cross-CTA writes."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    m, k, n = 300, 128, 256
    # cluster_m pairs of 64-row halves: group 3's second half holds none of its rows; the
    # rows past every group (256-299) make a pair whose second half starts at 320, past
    # lhs's 304 padded rows.
    sizes = (70, 0, 100, 3, 83)
    lhs, rhs, group_sizes, _, key = _inputs(m, k, n, sizes)
    single = dataclasses.replace(SMALL, grid_size=4)
    paired = dataclasses.replace(single, **CLUSTERS[cluster])
    params = plgpu.InterpretGPUParams(detect_races=True)
    if product == "swiglu":
        w_up = (jax.random.normal(key, rhs.shape, jnp.float32) / 4).astype(jnp.bfloat16)

        def run(config, interpret):
            return mosaic_gpu.gmm_swiglu(
                lhs, rhs, w_up, group_sizes, config=config, interpret=interpret
            )

        expected = reference.gmm_swiglu(lhs, rhs, w_up, group_sizes)
    else:
        transpose = product == "dgrad"
        operand = jnp.swapaxes(rhs, 1, 2) if transpose else rhs
        operand = operand[:, :, :k] if transpose else operand

        def run(config, interpret):
            return mosaic_gpu.gmm(
                lhs,
                operand,
                group_sizes,
                transpose_rhs=transpose,
                config=config,
                interpret=interpret,
            )

        expected = reference.gmm(lhs, operand, group_sizes, transpose_rhs=transpose)
    out = jax.block_until_ready(run(paired, params))
    assert not gpu_callbacks.get_races().races_found
    _assert_close(out, expected, jnp.bfloat16)
    chex.assert_trees_all_equal(out, run(single, True))


@pytest.mark.parametrize("consumer_dim", [pytest.param("n", marks=SLOW), "m"])
@pytest.mark.parametrize("delay_release", [pytest.param(0, marks=SLOW), 1])
@pytest.mark.parametrize("product", ["gmm", pytest.param("swiglu", marks=SLOW)])
def test_no_races_between_warpgroups(product, delay_release, consumer_dim):
    """Invariants 5 and 6 under the interpreter's race detector: the producer refills a stage
    only after both consumers released it, across tiles (two stages, three K steps a tile, so
    the ring wraps inside tiles and across their boundaries)."""
    # The race detector prints; its private state says whether it found one.
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    m, k, n = 300, 192, 256
    sizes = (70, 0, 100, 3, 64)
    lhs, w_gate, group_sizes, _, key = _inputs(m, k, n, sizes)
    w_up = (jax.random.normal(key, w_gate.shape, jnp.float32) / 4).astype(jnp.bfloat16)
    # 128 x 256 tiles: each consumer stores four 64 x 64 sub-tiles, so the epilogue reuses
    # its two buffers inside a tile, and row boundaries fall inside a consumer's part.
    config = dataclasses.replace(
        SMALL,
        block_m=128,
        block_n=256,
        delay_release=delay_release,
        max_concurrent_steps=2,
        consumer_dim=consumer_dim,
    )
    params = plgpu.InterpretGPUParams(detect_races=True)
    out, expected = _gmm_or_swiglu(product, lhs, w_gate, w_up, group_sizes, config, params)
    jax.block_until_ready(out)
    assert not gpu_callbacks.get_races().races_found
    _assert_close(out, expected, jnp.bfloat16)


def test_no_rows_and_no_groups():
    lhs, rhs, _, _, _ = _inputs(8, 64, 128, (8,))
    out = mosaic_gpu.gmm(lhs[:0], rhs, jnp.array([0], jnp.int32), config=SMALL, interpret=True)
    chex.assert_shape(out, (0, 128))
    out = mosaic_gpu.gmm(lhs, rhs[:0], jnp.zeros((0,), jnp.int32), config=SMALL, interpret=True)
    chex.assert_trees_all_equal(out, jnp.zeros((8, 128), jnp.bfloat16))
    # K = 0: an empty sum is 0 (no kernel runs, no barrier is touched).
    out = mosaic_gpu.gmm(
        lhs[:, :0], rhs[:, :0], jnp.array([8], jnp.int32), config=SMALL, interpret=True
    )
    chex.assert_trees_all_equal(out, jnp.zeros((8, 128), jnp.bfloat16))


def _shifted(lhs, rhs, sizes, pad, key):
    """The same rows behind `pad` rows of an extra leading group (its own random weights)."""
    pad_rows = jax.random.normal(key, (pad, lhs.shape[1]), jnp.float32).astype(lhs.dtype)
    pad_rhs = jax.random.normal(key, (1, *rhs.shape[1:]), jnp.float32).astype(rhs.dtype)
    return (
        jnp.concatenate([pad_rows, lhs]),
        jnp.concatenate([pad_rhs, rhs]),
        jnp.asarray((pad, *sizes), jnp.int32),
    )


def _check_offset_independence(m, k, n, sizes, pad, config, interpret):
    lhs, rhs, group_sizes, scale, key = _inputs(m, k, n, sizes)
    lhs_s, rhs_s, sizes_s = _shifted(lhs, rhs, sizes, pad, key)
    scale_s = jnp.concatenate([jnp.ones((pad,), jnp.float32), scale])
    run = dict(config=config, interpret=interpret)
    pairs = [
        (
            mosaic_gpu.gmm(lhs, rhs, group_sizes, row_scale_m=scale, out_dtype=jnp.float32, **run),
            mosaic_gpu.gmm(
                lhs_s, rhs_s, sizes_s, row_scale_m=scale_s, out_dtype=jnp.float32, **run
            ),
        ),
        (
            mosaic_gpu.gmm_swiglu(lhs, rhs, rhs, group_sizes, **run),
            mosaic_gpu.gmm_swiglu(lhs_s, rhs_s, rhs_s, sizes_s, **run),
        ),
    ]
    for plain, shifted in pairs:
        chex.assert_trees_all_equal(shifted[pad:], plain)


@pytest.mark.slow
def test_row_bits_do_not_depend_on_where_the_group_starts():
    """Invariant 1: the shifted rows' outputs are bitwise those of the unshifted call."""
    _check_offset_independence(131, 128, 128, (3, 60, 0, 68), pad=13, config=SMALL, interpret=True)


def test_schedule_covers_every_row_once():
    sizes = jnp.array([70, 0, 100, 1, 9], jnp.int32)
    m, block_m = 203, 64
    group_t, row0_t = mosaic_gpu.tile_schedule(sizes, num_rows=m, block_m=block_m)
    starts, ends = mosaic_gpu.group_bounds(sizes, num_rows=m)
    writes = np.zeros(m, np.int32)
    owner = np.full(m, -1)
    for g, r0 in zip(np.asarray(group_t), np.asarray(row0_t), strict=True):
        assert r0 % 8 == 0
        lo, hi = max(int(starts[g]), r0), min(int(ends[g]), r0 + block_m)
        writes[lo:hi] += 1
        owner[lo:hi] = g
    chex.assert_trees_all_equal(writes, np.ones(m, np.int32))
    expected_owner = np.asarray(reference.group_ids(sizes, m))
    chex.assert_trees_all_equal(owner, expected_owner)


# ---------------------------------------------------------------------------------------------
# Input validation.


def _bad_call(kind):
    lhs, rhs, sizes, scale, _ = _inputs(64, 128, 128, (64,))
    run = dict(config=SMALL, interpret=True)
    calls = {
        "f32": lambda: mosaic_gpu.gmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes),
        "mixed": lambda: mosaic_gpu.gmm(lhs, rhs.astype(jnp.float16), sizes),
        "rank": lambda: mosaic_gpu.gmm(lhs, rhs[0], sizes),
        "k": lambda: mosaic_gpu.gmm(lhs[:, :64], rhs, sizes),
        "k_tile": lambda: mosaic_gpu.gmm(lhs[:, :96], rhs[:, :96], sizes, **run),
        "n_tile": lambda: mosaic_gpu.gmm(lhs, rhs[:, :, :64], sizes, **run),
        "sizes_shape": lambda: mosaic_gpu.gmm(lhs, rhs, jnp.array([32, 32], jnp.int32)),
        "sizes_dtype": lambda: mosaic_gpu.gmm(lhs, rhs, sizes.astype(jnp.float32)),
        "out_dtype": lambda: mosaic_gpu.gmm(lhs, rhs, sizes, out_dtype=jnp.float16),
        "scale": lambda: mosaic_gpu.gmm(lhs, rhs, sizes, row_scale_m=scale[:10]),
        "smem": lambda: mosaic_gpu.gmm(
            lhs, rhs, sizes, config=TileConfig(block_n=128, max_concurrent_steps=12)
        ),
        "swiglu_up": lambda: mosaic_gpu.gmm_swiglu(lhs, rhs, rhs[:, :, :64], sizes),
        "parts_k": lambda: mosaic_gpu.gmm(lhs, (rhs, rhs), sizes),
        "parts_shape": lambda: mosaic_gpu.gmm(lhs, (rhs[:, :64], rhs[:, :64, :64]), sizes),
        "parts_tile": lambda: mosaic_gpu.gmm(
            lhs,
            (rhs[:, :64], rhs[:, :64]),
            sizes,
            config=dataclasses.replace(SMALL, block_k=128),
            interpret=True,
        ),
        "parts_empty": lambda: mosaic_gpu.gmm(lhs, (), sizes),
        "bwd_dy": lambda: mosaic_gpu.gmm_swiglu_bwd(lhs, lhs[:, :64], rhs, rhs, rhs, sizes),
        "bwd_w_down": lambda: mosaic_gpu.gmm_swiglu_bwd(lhs, lhs, rhs, rhs, rhs[:, :, :64], sizes),
        "bwd_f": lambda: mosaic_gpu.gmm_swiglu_bwd(
            lhs, lhs, rhs[:, :, :96], rhs[:, :, :96], rhs[:, :96], sizes
        ),
        "bwd_cluster": lambda: mosaic_gpu.gmm_swiglu_bwd(
            lhs,
            lhs,
            rhs,
            rhs,
            rhs,
            sizes,
            config=dataclasses.replace(SMALL, cluster_m=2),
            interpret=True,
        ),
        "epi_row": lambda: mosaic_gpu.gmm(
            lhs, rhs, sizes, config=dataclasses.replace(SMALL, epi_block_n=32), interpret=True
        ),
        "cluster_odd": lambda: mosaic_gpu.gmm(
            lhs, rhs, sizes, config=dataclasses.replace(SMALL, cluster_n=2), interpret=True
        ),
    }
    return calls[kind]


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("f32", "lhs dtype float32 must be bfloat16 or float16"),
        ("mixed", "rhs dtype float16 must equal lhs dtype bfloat16"),
        ("rank", r"rhs must be rank 3 \[G, ., .\], got shape \(128, 128\)"),
        ("k", "lhs K=64 must equal rhs K=128"),
        ("k_tile", "K=96 must be a multiple of block_k=64"),
        ("n_tile", "N=64 must be a multiple of block_n=128"),
        ("sizes_shape", r"group_sizes shape \(2,\) must be \[G\] with G=1"),
        ("sizes_dtype", "group_sizes dtype float32 must be int32"),
        ("out_dtype", "out_dtype float16 must be the lhs dtype bfloat16 or float32"),
        ("scale", r"row_scale_m must be float32 \[M=64\], got float32 \(10,\)"),
        ("smem", "bytes of shared memory, more than the"),
        ("swiglu_up", r"w_up shape \(1, 128, 64\) must equal w_gate shape \(1, 128, 128\)"),
        ("parts_k", r"lhs K=128 must equal rhs K=256 \(rhs shape 2 x \(1, 128, 128\)"),
        ("parts_shape", r"rhs\[1\] shape \(1, 64, 64\) must equal rhs\[0\] shape \(1, 64, 128\)"),
        ("parts_tile", "each of the 2 rhs parts holds K=64: it must be a multiple of block_k=128"),
        ("parts_empty", "rhs_gkn must be an array or a non-empty tuple of arrays"),
        ("bwd_dy", r"dy must be bfloat16 \[M=64, N=128\] \(N = lhs K\), got bfloat16 \(64, 64\)"),
        (
            "bwd_w_down",
            r"w_down must be bfloat16 \[G=1, F=128, N=128\], got bfloat16 \(1, 128, 64\)",
        ),
        ("bwd_cluster", "gmm_swiglu_bwd runs without clusters"),
        ("bwd_f", "F=96 must be a multiple of 64"),
        (
            "epi_row",
            "epi_block_n=32 x 2-byte outputs = 64 bytes a row: it must be a multiple of 128",
        ),
        ("cluster_odd", "cluster_n=2 needs an even number of column tiles, got N=128"),
    ],
)
def test_bad_inputs_raise_naming_the_values(kind, message):
    with pytest.raises(ValueError, match=message):
        _bad_call(kind)()


# ---------------------------------------------------------------------------------------------
# GPU twins at real sizes.


def _uniform_group_sizes(m, g, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.bincount(rng.integers(0, g, m), minlength=g), jnp.int32)


def _sampled_rows_reference(lhs, rhs, group_sizes, rows, *, transpose_rhs=False):
    """f32 products of a few rows with their groups' matrices (the full reference is too slow)."""
    ids = np.asarray(reference.group_ids(group_sizes, lhs.shape[0]))[rows]
    out = []
    for row, g in zip(rows, ids, strict=True):
        if g == rhs.shape[0]:
            out.append(np.zeros(rhs.shape[1] if transpose_rhs else rhs.shape[2], np.float32))
            continue
        w = np.asarray(rhs[g], np.float32)
        w = w.T if transpose_rhs else w
        out.append(np.asarray(lhs[row], np.float32) @ w)
    return np.stack(out)


@pytest.mark.gpu
@pytest.mark.parametrize("product", ["gmm", "swiglu", *CLUSTERS])
def test_gpu_release_delay_does_not_change_bits(product):
    """Invariant 5 on the hardware (the interpreter runs wgmma synchronously, so only the GPU
    can show a stage refilled under a running wgmma): two stages and 64 K steps a tile, so
    the producer refills each stage right after its release; delay_release=1 (one step of
    wgmmas in flight when a stage is released) must give the bits of delay_release=0 and the
    reference's values. Clusters run the same check with the multicast lhs (cluster_n), rhs
    (cluster_m) or both (2 x 2)."""
    m, k, n, g = 4096, 4096, 512, 8
    keys = jax.random.split(jax.random.key(5), 3)
    lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / 64).astype(jnp.bfloat16)
    w_up = (jax.random.normal(keys[2], (g, k, n), jnp.float32) / 64).astype(jnp.bfloat16)
    sizes = _uniform_group_sizes(m - 40, g, 1)
    base = mosaic_gpu.default_config(n=n, swiglu=product == "swiglu")
    base = dataclasses.replace(base, max_concurrent_steps=2, **CLUSTERS.get(product, {}))

    def run(delay):
        config = dataclasses.replace(base, delay_release=delay)
        if product == "swiglu":
            return jax.jit(lambda a, b, c, s: mosaic_gpu.gmm_swiglu(a, b, c, s, config=config))(
                lhs, rhs, w_up, sizes
            )
        return jax.jit(
            lambda a, b, s: mosaic_gpu.gmm(a, b, s, out_dtype=jnp.float32, config=config)
        )(lhs, rhs, sizes)

    delayed, eager = run(1), run(0)
    chex.assert_trees_all_equal(delayed, eager)
    rows = np.random.default_rng(6).choice(m - 40, 128, replace=False)
    if product == "swiglu":
        gate = _sampled_rows_reference(lhs, rhs, sizes, rows)
        up = _sampled_rows_reference(lhs, w_up, sizes, rows)
        expected = gate / (1 + np.exp(-gate)) * up
        _assert_close(np.asarray(delayed)[rows], expected, jnp.bfloat16)
    else:
        expected = _sampled_rows_reference(lhs, rhs, sizes, rows)
        _assert_close(np.asarray(delayed)[rows], expected, jnp.float32)


@pytest.mark.gpu
def test_gpu_row_bits_do_not_depend_on_where_the_group_starts():
    """Invariant 1 on the hardware: wgmma computes a row the same way at any tile position."""
    sizes = tuple(int(s) for s in _uniform_group_sizes(4000, 16, 5))
    _check_offset_independence(4000, 2048, 1536, sizes, pad=13, config=None, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", list(CLUSTERS))
@pytest.mark.parametrize("product", ["gmm", "dgrad", "scaled_f32", "swiglu"])
def test_gpu_clusters_give_the_single_cta_bits(product, cluster):
    """Invariant 7 on the hardware at a real size (qwen3 gate_up, M not a multiple of 8, rows
    past every group): clusters of 2 or 2 x 2 CTAs, with the multicast lhs, rhs or both,
    give the bits of one CTA a cluster (with cluster_m, pairs whose second half holds no rows
    of its group, or starts past M, are common)."""
    m, k, n, g = 16381, 2048, 1536, 128
    keys = jax.random.split(jax.random.key(7), 4)
    lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    shape = (g, n, k) if product == "dgrad" else (g, k, n)
    rhs = (jax.random.normal(keys[1], shape, jnp.float32) / 32).astype(jnp.bfloat16)
    w_up = (jax.random.normal(keys[2], shape, jnp.float32) / 32).astype(jnp.bfloat16)
    scale = jax.random.uniform(keys[3], (m,), jnp.float32)
    sizes = _uniform_group_sizes(m - 300, g, 8)
    single = mosaic_gpu.default_config(
        n=n,
        transpose_rhs=product == "dgrad",
        out_dtype=jnp.float32 if product == "scaled_f32" else None,
        swiglu=product == "swiglu",
    )
    single = dataclasses.replace(single, cluster_n=1, cluster_m=1)
    paired = dataclasses.replace(single, **CLUSTERS[cluster])

    def run(config):
        if product == "swiglu":
            fn = functools.partial(mosaic_gpu.gmm_swiglu, config=config)
            return jax.jit(fn)(lhs, rhs, w_up, sizes)
        if product == "scaled_f32":
            fn = functools.partial(mosaic_gpu.gmm, out_dtype=jnp.float32, config=config)
            return jax.jit(fn)(lhs, rhs, sizes, row_scale_m=scale)
        fn = functools.partial(mosaic_gpu.gmm, transpose_rhs=product == "dgrad", config=config)
        return jax.jit(fn)(lhs, rhs, sizes)

    out = run(paired)
    chex.assert_trees_all_equal(out, run(single))
    chex.assert_trees_all_equal(out[m - 300 :], jnp.zeros_like(out[m - 300 :]))
    rows = np.random.default_rng(9).choice(m - 300, 128, replace=False)
    expected = _sampled_rows_reference(lhs, rhs, sizes, rows, transpose_rhs=product == "dgrad")
    if product == "swiglu":
        up = _sampled_rows_reference(lhs, w_up, sizes, rows)
        expected = expected / (1 + np.exp(-expected)) * up
    elif product == "scaled_f32":
        expected = expected * np.asarray(scale)[rows, None]
    _assert_close(np.asarray(out)[rows], expected, out.dtype)
