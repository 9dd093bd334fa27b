"""The tests' GPU interpret mode (tests/conftest.py): its WGMMA gives a row the same bits
wherever the row sits, as the GPU's does, so the interpret twins of the kernels' bitwise
invariants test the kernels and not the host's BLAS."""

import chex
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from mok_jax.tolerances import tolerance
from pallas_kernels.grouped_matmul import mosaic_gpu, reference, tuning


def _rows(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    return a, b


def _assert_same_bits(x, y):
    chex.assert_trees_all_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))


@pytest.mark.parametrize("shift", [1, 5, 6, 13])
def test_a_rows_bits_do_not_depend_on_where_it_sits(shift):
    a, b = _rows(64 + shift, 64, 128)
    matmul = gpu_callbacks.np.matmul
    first = matmul(a[:64], b, dtype=np.float32)
    shifted = matmul(a[shift:], b, dtype=np.float32)
    _assert_same_bits(shifted[: 64 - shift], first[shift:])


def test_columns_too_and_the_values_are_the_product():
    a, b = _rows(40, 96, 136, seed=1)
    matmul = gpu_callbacks.np.matmul
    full = matmul(a, b, dtype=np.float32)
    _assert_same_bits(matmul(a, b[:, 7:], dtype=np.float32), full[:, 7:])
    exact = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(full, exact, rtol=0, atol=1e-4)
    assert full.dtype == np.float32


def test_the_rest_of_numpy_is_numpy():
    assert gpu_callbacks.np.matmul is not np.matmul
    assert gpu_callbacks.np.asarray is np.asarray
    with pytest.raises(ValueError, match=r"\[M, K\] @ \[K, N\]"):
        gpu_callbacks.np.matmul(np.ones((2, 3, 4)), np.ones((4, 5)))


def test_the_interpreted_wgmma_runs_through_it(monkeypatch):
    """A grouped GEMM in interpret mode calls the harness's matmul for its WGMMAs (a jax that
    stopped calling gpu_callbacks.np.matmul would leave the BLAS in charge unseen)."""
    calls = []
    in_k_order = gpu_callbacks.np.matmul

    def counted(a, b, dtype=None):
        calls.append((a.shape, b.shape))
        return in_k_order(a, b, dtype=dtype)

    monkeypatch.setattr(gpu_callbacks.np, "matmul", counted)
    a, b = _rows(64, 64, 128, seed=2)
    lhs, rhs = jnp.asarray(a), jnp.asarray(b)[None]
    sizes = jnp.asarray([64], jnp.int32)
    got = mosaic_gpu.gmm(lhs, rhs, sizes, config=tuning.INTERPRET_CONFIG, interpret=True)
    assert calls, "the interpreted kernel ran no matmul of the harness"
    want = jnp.asarray(reference.gmm(lhs, rhs, sizes), jnp.float32)
    tol = tolerance(jnp.float32, got.dtype)
    chex.assert_trees_all_close(
        jnp.asarray(got, jnp.float32), want, rtol=tol.rtol, atol=tol.scaled_atol(want)
    )
