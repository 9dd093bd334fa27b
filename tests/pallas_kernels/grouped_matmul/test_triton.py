"""The Triton-lowered gmm (portable fallback): against reference.gmm in interpret mode on CPU,
input validation, CUDA lowering on this machine, and GPU-marked twins at real size."""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import reference
from pallas_kernels.grouped_matmul.triton import TritonTileConfig, gmm

# Lowering through Triton emits jax's deprecation warning for the Pallas Triton backend. gmm
# silences it when called eagerly; under jit it comes at lowering time, so the tests that lower
# on purpose ignore exactly that warning.
IGNORE_TRITON_DEPRECATION = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)
# One rounding of an f32 accumulator to the output dtype, relative to the output's scale.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2**-7, jnp.float16: 2**-9}
SMALL = TritonTileConfig(block_m=16, block_n=64, block_k=32)
H200 = jax.sharding.AbstractMesh(
    (1,),
    ("x",),
    abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"
    ),
)


def _inputs(seed, num_rows, num_k, num_n, num_groups, *, transpose_rhs, dtype=jnp.bfloat16):
    lhs_key, rhs_key = jax.random.split(jax.random.key(seed))
    rhs_shape = (num_groups, num_n, num_k) if transpose_rhs else (num_groups, num_k, num_n)
    lhs = jax.random.normal(lhs_key, (num_rows, num_k), jnp.float32).astype(dtype)
    rhs = jax.random.normal(rhs_key, rhs_shape, jnp.float32).astype(dtype)
    return lhs, rhs


def _assert_matches_reference(out, lhs, rhs, group_sizes, *, transpose_rhs):
    expected = reference.gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
    chex.assert_shape(out, expected.shape)
    chex.assert_type(out, lhs.dtype)
    tol = TOLERANCE[jnp.dtype(lhs.dtype).type]
    scale = float(jnp.max(jnp.abs(expected))) or 1.0
    chex.assert_trees_all_close(out.astype(jnp.float32), expected, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize(
    ("num_rows", "num_k", "num_n", "sizes"),
    [
        (1, 64, 64, [1]),
        (37, 128, 64, [10, 0, 20]),  # an empty group, rows of no group, M odd
        (200, 64, 128, [60, 0, 77, 50, 13]),  # partial tiles on both sides of each boundary
        (200, 64, 64, [0, 0, 0]),  # every row belongs to no group: zeros
        (50, 64, 64, [30, 40]),  # sum > M: clipped
    ],
)
def test_matches_reference(num_rows, num_k, num_n, sizes, transpose_rhs):
    lhs, rhs = _inputs(num_rows, num_rows, num_k, num_n, len(sizes), transpose_rhs=transpose_rhs)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out = gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, config=SMALL, interpret=True)
    _assert_matches_reference(out, lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)


def test_f32_inputs_under_jit():
    lhs, rhs = _inputs(1, 70, 64, 64, 3, transpose_rhs=False, dtype=jnp.float32)
    group_sizes = jnp.asarray([20, 0, 40], jnp.int32)
    run = jax.jit(lambda a, b, s: gmm(a, b, s, config=SMALL, interpret=True))
    _assert_matches_reference(
        run(lhs, rhs, group_sizes), lhs, rhs, group_sizes, transpose_rhs=False
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_m": 48}, "block_m=48 must be a power of two >= 16"),
        ({"block_k": 8}, "block_k=8 must be a power of two >= 16"),
        ({"num_warps": 3}, "num_warps=3 must be a power of two <= 16"),
        ({"num_stages": 0}, "num_stages=0 must be >= 1"),
    ],
)
def test_invalid_config_names_the_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TritonTileConfig(**kwargs)


@pytest.mark.parametrize(
    ("lhs_shape", "rhs_shape", "sizes", "message"),
    [
        ((8, 64), (2, 32, 64), [4, 4], "lhs_mk K=64 != rhs K=32"),
        ((8, 64), (2, 64, 64), [8], "group_sizes_g has 1 groups, rhs 2"),
        ((8, 48), (2, 48, 64), [4, 4], "K=48 must be a multiple of block_k=64"),
        ((8, 64), (2, 64, 64, 1), [4, 4], "must be 2-D and rhs_gkn"),
    ],
)
def test_bad_inputs_raise(lhs_shape, rhs_shape, sizes, message):
    lhs = jnp.zeros(lhs_shape, jnp.bfloat16)
    rhs = jnp.zeros(rhs_shape, jnp.bfloat16)
    with pytest.raises(ValueError, match=re.escape(message)):
        gmm(lhs, rhs, jnp.asarray(sizes, jnp.int32), interpret=True)


def test_mixed_dtypes_raise():
    with pytest.raises(ValueError, match="must share a dtype"):
        gmm(
            jnp.zeros((8, 64), jnp.bfloat16),
            jnp.zeros((1, 64, 128), jnp.float32),
            jnp.asarray([8], jnp.int32),
            interpret=True,
        )


@IGNORE_TRITON_DEPRECATION
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_lowers_for_cuda(transpose_rhs):
    num_rows, num_k, num_n, num_groups = 131072, 2048, 1536, 128
    rhs_shape = (num_groups, num_n, num_k) if transpose_rhs else (num_groups, num_k, num_n)
    args = (
        jax.ShapeDtypeStruct((num_rows, num_k), jnp.bfloat16),
        jax.ShapeDtypeStruct(rhs_shape, jnp.bfloat16),
        jax.ShapeDtypeStruct((num_groups,), jnp.int32),
    )
    with jax.sharding.use_abstract_mesh(H200):
        lowered = (
            jax.jit(lambda a, b, s: gmm(a, b, s, transpose_rhs=transpose_rhs))
            .trace(*args)
            .lower(lowering_platforms=("cuda",))
        )
    assert "triton" in lowered.as_text()


@pytest.mark.gpu
@IGNORE_TRITON_DEPRECATION
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gpu_real_size(transpose_rhs):
    num_rows, num_k, num_n, num_groups = 131072, 2048, 1536, 128
    lhs, rhs = _inputs(2, num_rows, num_k, num_n, num_groups, transpose_rhs=transpose_rhs)
    ids = np.random.default_rng(0).integers(0, num_groups, num_rows - 1000)
    group_sizes = jnp.asarray(np.bincount(ids, minlength=num_groups).astype(np.int32))
    run = jax.jit(lambda a, b, s: gmm(a, b, s, transpose_rhs=transpose_rhs))
    outs = [run(lhs, rhs, group_sizes) for _ in range(3)]
    for other in outs[1:]:
        chex.assert_trees_all_equal(outs[0], other)
    # reference.gmm, not lax.ragged_dot: XLA's GPU backend expands ragged_dot at this size
    # into one dense product over a [131072, 128 * 2048] operand (64 GiB).
    expected = jax.jit(reference.gmm, static_argnames="transpose_rhs")(
        lhs, rhs, group_sizes, transpose_rhs=transpose_rhs
    )
    scale = float(jnp.max(jnp.abs(expected)))
    tol = TOLERANCE[jnp.bfloat16]
    chex.assert_trees_all_close(outs[0].astype(jnp.float32), expected, rtol=tol, atol=tol * scale)
    chex.assert_trees_all_equal(outs[0][num_rows - 1000 :], jnp.zeros((1000, num_n), lhs.dtype))
