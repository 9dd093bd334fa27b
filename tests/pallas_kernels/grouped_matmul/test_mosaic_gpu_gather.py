"""Gathered lhs rows (invariant 8 of mosaic_gpu.py): gmm and gmm_swiglu read row m from lhs
row lhs_rows_m[m] and give the bits of the same call on the materialized lhs[lhs_rows_m]. That
contract (with the reference's values, the lowering for CUDA and the GPU twin) is a set of rows
of tests/pallas_kernels/test_contracts.py, on this file's CASES; here, the race checks, the
default tiles' clusters, clipped rows, empty calls and bad gathers."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import mosaic_gpu, tuning

SMALL = tuning.INTERPRET_CONFIG

# (T lhs rows, M gathered rows, K, N, group sizes): more rows than tokens (top-k > 1), fewer,
# M not a multiple of 8, empty groups, rows past every group.
CASES = [
    (50, 131, 128, 128, (3, 60, 0, 64)),
    (300, 37, 64, 256, (37,)),
]


def _inputs(t, m, k, n, sizes, *, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    g = len(sizes)
    x = jax.random.normal(keys[0], (t, k), jnp.float32).astype(jnp.bfloat16)
    w_gate, w_up = (
        (jax.random.normal(key, (g, k, n), jnp.float32) / 4).astype(jnp.bfloat16)
        for key in keys[1:3]
    )
    rows = jax.random.randint(keys[3], (m,), 0, t, jnp.int32)
    scale = jax.random.uniform(keys[4], (m,), jnp.float32, 0.5, 1.5)
    return x, w_gate, w_up, rows, jnp.asarray(sizes, jnp.int32), scale


@pytest.mark.slow
@pytest.mark.parametrize("delay_release", [0, 1])
def test_gathered_rows_have_no_races(delay_release):
    """Invariants 5, 6 and 8 under the race detector: block_m row copies and the rhs copy
    arrive on one stage barrier; two stages, three K steps a tile."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    x, w_gate, w_up, rows, sizes, _ = _inputs(40, 200, 192, 128, (70, 0, 100))
    config = dataclasses.replace(SMALL, max_concurrent_steps=2, delay_release=delay_release)
    params = plgpu.InterpretGPUParams(detect_races=True)
    out = mosaic_gpu.gmm_swiglu(
        x, w_gate, w_up, sizes, lhs_rows_m=rows, config=config, interpret=params
    )
    jax.block_until_ready(out)
    assert not gpu_callbacks.get_races().races_found
    expected = mosaic_gpu.gmm_swiglu(x[rows], w_gate, w_up, sizes, config=SMALL, interpret=True)
    chex.assert_trees_all_equal(out, expected)


def test_a_default_config_with_clusters_runs_gathered_rows_without_them(monkeypatch):
    """The table's config may have clusters, which gathered rows do not take: the default is
    stripped of them (a caller's config is refused instead, see the bad-input test)."""
    clustered = dataclasses.replace(SMALL, cluster_n=2)
    monkeypatch.setitem(tuning.DEFAULT_CONFIGS, ("gmm", tuning.INTERPRET), clustered)
    x, w_gate, _, rows, sizes, _ = _inputs(*CASES[1])
    out = mosaic_gpu.gmm(x, w_gate, sizes, lhs_rows_m=rows, interpret=True)
    chex.assert_trees_all_equal(
        out, mosaic_gpu.gmm(x[rows], w_gate, sizes, config=SMALL, interpret=True)
    )


@pytest.mark.slow
def test_out_of_range_rows_are_clipped():
    x, w_gate, _, rows, sizes, _ = _inputs(*CASES[1])
    wild = rows.at[:5].set(jnp.array([-7, -1, 300, 301, 10**6], jnp.int32))
    out = mosaic_gpu.gmm(x, w_gate, sizes, lhs_rows_m=wild, config=SMALL, interpret=True)
    expected = mosaic_gpu.gmm(
        x[jnp.clip(wild, 0, 299)], w_gate, sizes, config=SMALL, interpret=True
    )
    chex.assert_trees_all_equal(out, expected)


def test_no_gathered_rows_and_no_lhs_rows():
    x, w_gate, _, rows, sizes, _ = _inputs(*CASES[1])
    out = mosaic_gpu.gmm(x, w_gate, sizes, lhs_rows_m=rows[:0], config=SMALL, interpret=True)
    chex.assert_shape(out, (0, 256))
    with pytest.raises(ValueError, match="lhs has no rows to gather 37 rows from"):
        mosaic_gpu.gmm(x[:0], w_gate, sizes, lhs_rows_m=rows, config=SMALL, interpret=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rows_dtype": jnp.int16}, r"lhs_rows_m must be int32 \[M\], got int16 \(37,\)"),
        ({"config": {"block_k": 128}}, "gathered rows need block_k \\* itemsize = 128 bytes"),
        ({"config": {"cluster_m": 2}}, "gathered rows run without clusters"),
        ({"scale_rows": 36}, r"row_scale_m must be float32 \[M=37\], got float32 \(36,\)"),
    ],
    ids=["rows_dtype", "block_k", "cluster", "scale"],
)
def test_bad_gathers_raise_naming_the_values(change, message):
    # K = 128: block_k 128 is a valid TileConfig, not a valid gather.
    x, w_gate, _, rows, sizes, scale = _inputs(300, 37, 128, 256, (37,))
    rows = rows.astype(change.get("rows_dtype", jnp.int32))
    config = dataclasses.replace(SMALL, **change.get("config", {}))
    kwargs = {}
    if "scale_rows" in change:
        kwargs = dict(row_scale_m=scale[: change["scale_rows"]], out_dtype=jnp.float32)
    with pytest.raises(ValueError, match=message):
        mosaic_gpu.gmm(x, w_gate, sizes, lhs_rows_m=rows, config=config, interpret=True, **kwargs)
