"""Gathered lhs rows (invariant 8 of mosaic_gpu.py): gmm and gmm_swiglu read row m from lhs
row lhs_rows_m[m] and give the bits of the same call on the materialized lhs[lhs_rows_m]."""

from __future__ import annotations

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import mosaic_gpu, reference, tuning
from pallas_kernels.tolerances import tolerance

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


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("product", ["gmm", "weighted_f32", "swiglu"])
def test_gathered_rows_give_the_bits_of_the_gathered_lhs(case, product):
    x, w_gate, w_up, rows, sizes, scale = _inputs(*case)
    run = dict(config=SMALL, interpret=True)
    if product == "gmm":
        out = mosaic_gpu.gmm(x, w_gate, sizes, lhs_rows_m=rows, **run)
        expected = mosaic_gpu.gmm(x[rows], w_gate, sizes, **run)
        spec = reference.gmm(x[rows], w_gate, sizes)
    elif product == "weighted_f32":
        kwargs = dict(row_scale_m=scale, out_dtype=jnp.float32, **run)
        out = mosaic_gpu.gmm(x, w_gate, sizes, lhs_rows_m=rows, **kwargs)
        expected = mosaic_gpu.gmm(x[rows], w_gate, sizes, **kwargs)
        spec = reference.gmm(x[rows], w_gate, sizes) * scale[:, None]
    else:
        out = mosaic_gpu.gmm_swiglu(x, w_gate, w_up, sizes, lhs_rows_m=rows, **run)
        expected = mosaic_gpu.gmm_swiglu(x[rows], w_gate, w_up, sizes, **run)
        spec = reference.gmm_swiglu(x[rows], w_gate, w_up, sizes)
    chex.assert_shape(out, expected.shape)
    chex.assert_trees_all_equal(out, expected)
    tol = tolerance(jnp.float32, out.dtype)
    chex.assert_trees_all_close(
        out.astype(jnp.float32), spec, rtol=tol.rtol, atol=tol.scaled_atol(spec)
    )


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


@pytest.mark.parametrize("lhs_rows", [1, 300], ids=["one_lhs_row", "many"])
def test_gathered_rows_of_the_transposed_product_and_of_one_lhs_row(lhs_rows):
    """dgrad's layout (rhs [G, N, K]) gathers the same way; T = 1: every row is lhs row 0."""
    x, w_gate, _, rows, sizes, _ = _inputs(lhs_rows, 37, 128, 256, (37,))
    w_t = jnp.swapaxes(w_gate, 1, 2)
    run = dict(transpose_rhs=True, config=SMALL, interpret=True)
    out = mosaic_gpu.gmm(x, w_t, sizes, lhs_rows_m=rows, **run)
    chex.assert_trees_all_equal(out, mosaic_gpu.gmm(x[rows], w_t, sizes, **run))


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


# ---------------------------------------------------------------------------------------------
# CUDA lowering on this machine at a real size (qwen3-30b-a3b: 16384 tokens, top-8 routing).

T, TOP_K, D, F, E = 16384, 8, 2048, 768, 128
_S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("product", ["swiglu", "weighted_f32"])
def test_gathered_rows_lower_for_cuda_at_real_size(product):
    bf16 = jnp.bfloat16
    rows, sizes = _S((T * TOP_K,), jnp.int32), _S((E,), jnp.int32)
    if product == "swiglu":
        fn = lambda x, w1, w2, s, r: mosaic_gpu.gmm_swiglu(x, w1, w2, s, lhs_rows_m=r)  # noqa: E731
        args = (_S((T, D), bf16), _S((E, D, F), bf16), _S((E, D, F), bf16), sizes, rows)
    else:
        fn = lambda x, w, s, r, c: mosaic_gpu.gmm(  # noqa: E731
            x, w, s, lhs_rows_m=r, row_scale_m=c, out_dtype=jnp.float32
        )
        args = (_S((T, F), bf16), _S((E, F, D), bf16), sizes, rows, _S((T * TOP_K,), jnp.float32))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert re.search(r"custom_call @mosaic_gpu", text), "no Mosaic GPU kernel in the lowering"


# ---------------------------------------------------------------------------------------------
# GPU twin: the swizzled one-row copies on the hardware.


@pytest.mark.gpu
@pytest.mark.parametrize("product", ["swiglu", "weighted_f32"])
def test_gpu_gathered_rows_give_the_bits_of_the_gathered_lhs(product):
    keys = jax.random.split(jax.random.key(3), 5)
    num_rows = T * TOP_K
    order = jax.random.permutation(keys[0], num_rows).astype(jnp.int32)
    rows = order // TOP_K  # the expert-sorted order's tokens, as the layer's plan gives them
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(np.bincount(rng.integers(0, E, num_rows - 40), minlength=E), jnp.int32)
    k_dim, n_dim = (D, F) if product == "swiglu" else (F, D)
    x = jax.random.normal(keys[1], (T, k_dim), jnp.float32).astype(jnp.bfloat16)
    w1, w2 = (
        (jax.random.normal(key, (E, k_dim, n_dim), jnp.float32) / 32).astype(jnp.bfloat16)
        for key in keys[2:4]
    )
    scale = jax.random.uniform(keys[4], (num_rows,), jnp.float32)
    if product == "swiglu":
        fn = jax.jit(lambda a, r: mosaic_gpu.gmm_swiglu(a, w1, w2, sizes, lhs_rows_m=r))
        plain = jax.jit(lambda a: mosaic_gpu.gmm_swiglu(a, w1, w2, sizes))
    else:
        kwargs = dict(row_scale_m=scale, out_dtype=jnp.float32)
        fn = jax.jit(lambda a, r: mosaic_gpu.gmm(a, w1, sizes, lhs_rows_m=r, **kwargs))
        plain = jax.jit(lambda a: mosaic_gpu.gmm(a, w1, sizes, **kwargs))
    outs = [fn(x, rows) for _ in range(3)]
    for other in outs[1:]:
        chex.assert_trees_all_equal(other, outs[0])
    chex.assert_trees_all_equal(outs[0], plain(x[rows]))
