"""The custom_vjp ops beyond their contract: the backward's variants (from the saved gate and
up, from g, without the input gradient, the recomputations) give the bits or values they
promise, the scaled cotangent's rounding, no concatenated weight copies, no gradient for the
group sizes, bad calls; under GPU interpret mode on CPU. Each op's values and gradients (one
random cotangent) against jax.vjp of the reference, its lowering for CUDA and its GPU twin are
rows of tests/pallas_kernels/test_contracts.py, on this file's CASES.

The backward passes call `mosaic_gpu_wgrad.tgmm` (the weight-gradient kernel) for d_rhs."""

from __future__ import annotations

import functools

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import ops
from pallas_kernels.tolerances import tolerance

# (M, K, N, group sizes): an empty group, partial tiles, rows past every group.
CASES = [
    (131, 128, 128, (3, 60, 0, 50)),
    (64, 128, 128, (64,)),
]


def _inputs(m, k, n, sizes, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    g = len(sizes)

    def bf16(key, shape, scale=1.0):
        return (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)

    return dict(
        x=bf16(keys[0], (m, k)),
        w=bf16(keys[1], (g, k, n), 0.25),
        w2=bf16(keys[2], (g, k, n), 0.25),
        w_t=bf16(keys[3], (g, n, k), 0.25),
        scale=jax.random.uniform(keys[4], (m,), jnp.float32, 0.5, 1.5),
        cotangent=jax.random.normal(keys[5], (m, n), jnp.float32),
        sizes=jnp.asarray(sizes, jnp.int32),
    )


def _assert_close(actual, expected, compute=jnp.float32):
    """Each leaf to the rounding of its stored dtype (bf16 gradients, f32 values), or of the
    compute dtype where a rounded intermediate (h) feeds it."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        chex.assert_type(a, e.dtype)
        tol = tolerance(compute, a.dtype)
        e32 = jnp.asarray(e, jnp.float32)
        chex.assert_trees_all_close(
            jnp.asarray(a, jnp.float32), e32, rtol=tol.rtol, atol=tol.scaled_atol(e32)
        )


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ops.RECOMPUTES)
def test_swiglu_mlp_grads_from_the_saved_gate_up(recompute):
    """saved=(h, gate, up) of gmm_swiglu(gate_up_out=True): "gmm" recomputes the same h and
    rounds gate and up to bf16 as the kernel stores them, so every gradient has its bits.
    "kernel" has the same h, so d_w_down is its bits too, and d_s the same f32 products,
    f32-close (it sums a tile's columns, then the tiles); the rest see gate and up unrounded
    there: close."""
    from pallas_kernels.grouped_matmul import mosaic_gpu

    t = _inputs(*CASES[0])
    args = (t["x"], t["w"], t["w2"], t["w_t"], t["sizes"], t["scale"], t["cotangent"])
    saved = mosaic_gpu.gmm_swiglu(
        t["x"], t["w"], t["w2"], t["sizes"], gate_up_out=True, interpret=True
    )
    recomputed = ops.swiglu_mlp_grads(*args, recompute=recompute, interpret=True)
    from_saved = ops.swiglu_mlp_grads(*args, saved=saved, interpret=True)
    if recompute == "gmm":
        chex.assert_trees_all_equal(from_saved, recomputed)
        return
    chex.assert_trees_all_equal(from_saved[3], recomputed[3])  # d_w_down
    _assert_close(from_saved[5], recomputed[5])  # d_s, f32
    for i in (0, 1, 2):  # d_lhs, d_w_gate, d_w_up
        _assert_close(from_saved[i], recomputed[i], jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_mlp_grads_from_g_give_the_bits_of_the_recomputing_backward(weighted):
    """From g = dy @ w_down[g].T (f32) and dy times the row scale (bf16), formed as the
    exchange's backward forms them (dy rounded first for both: scaled_cotangent), every
    gradient is that of swiglu_mlp_grads(dy, recompute="gmm"), bit for bit."""
    from pallas_kernels.grouped_matmul import mosaic_gpu

    t = _inputs(*CASES[0])
    scale = t["scale"] if weighted else None
    dy = t["cotangent"]
    weights = (t["w"], t["w2"], t["w_t"])
    g = mosaic_gpu.gmm(dy.astype(t["x"].dtype), t["w_t"], t["sizes"], transpose_rhs=True,
                       out_dtype=jnp.float32, interpret=True)  # fmt: skip
    dy_c = dy.astype(t["x"].dtype)
    dy_down = dy_c if scale is None else ops.scaled_cotangent(dy_c, scale)
    got = ops.swiglu_mlp_grads_from_g(t["x"], *weights, t["sizes"], scale, g, dy_down,
                                      interpret=True)  # fmt: skip
    want = ops.swiglu_mlp_grads(t["x"], *weights, t["sizes"], scale, dy, recompute="gmm",
                                interpret=True)  # fmt: skip
    chex.assert_trees_all_equal(got, want)
    # A g of other bits gives other gradients: the comparison can fail.
    other = ops.swiglu_mlp_grads_from_g(t["x"], *weights, t["sizes"], scale, g + 1e-3, dy_down,
                                        interpret=True)  # fmt: skip
    assert not np.array_equal(np.asarray(other[0], np.float32), np.asarray(want[0], np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("case", [0, 1])
@pytest.mark.parametrize("recompute", [*ops.RECOMPUTES, "from_g"])
def test_swiglu_mlp_grads_without_the_input_grad_hand_back_its_gemm_operand(recompute, case):
    """input_grad=False: the first output is [d_gate | d_up] ([M, 2F]), from which
    swiglu_input_grad gives d_lhs bit for bit; the other gradients are unchanged (case 0: an
    empty group and rows past the groups)."""
    from pallas_kernels.grouped_matmul import mosaic_gpu

    t = _inputs(*CASES[case])
    weights = (t["w"], t["w2"], t["w_t"])
    args = (t["x"], *weights, t["sizes"], t["scale"])
    if recompute == "from_g":
        g = mosaic_gpu.gmm(t["cotangent"].astype(t["x"].dtype), t["w_t"], t["sizes"],
                           transpose_rhs=True, out_dtype=jnp.float32, interpret=True)  # fmt: skip
        dy_down = ops.scaled_cotangent(t["cotangent"].astype(t["x"].dtype), t["scale"])
        run = functools.partial(ops.swiglu_mlp_grads_from_g, *args, g, dy_down, interpret=True)
    else:
        run = functools.partial(ops.swiglu_mlp_grads, *args, t["cotangent"], recompute=recompute,
                                interpret=True)  # fmt: skip
    want = run()
    got = run(input_grad=False)
    d_gate_up = got[0]
    chex.assert_shape(d_gate_up, (t["x"].shape[0], 2 * t["w"].shape[2]))
    chex.assert_type(d_gate_up, t["x"].dtype)
    d_lhs = ops.swiglu_input_grad(d_gate_up, t["w"], t["w2"], t["sizes"], interpret=True)
    chex.assert_trees_all_equal((d_lhs, *got[1:]), want)


def test_the_scaled_cotangent_rounds_dy_first():
    """dy times the row scale is formed from dy rounded to the compute dtype, so that a device
    holding only the rounded rows forms the same bits; from f32 dy some differ."""
    t = _inputs(*CASES[0])
    dy, scale = t["cotangent"], t["scale"]
    dy_c = dy.astype(jnp.bfloat16)
    got = ops.scaled_cotangent(dy_c, scale)
    chex.assert_type(got, jnp.bfloat16)
    want = (dy_c.astype(jnp.float32) * scale[:, None]).astype(jnp.bfloat16)
    chex.assert_trees_all_equal(got, want)
    from_f32 = (dy.astype(jnp.float32) * scale[:, None]).astype(jnp.bfloat16)
    assert not np.array_equal(np.asarray(got, np.float32), np.asarray(from_f32, np.float32))


@pytest.mark.slow
def test_swiglu_mlp_recomputes_agree_and_bad_ones_raise():
    """ "gmm" and "kernel" form the same h (so d_w_down has the same bits) from the same f32
    products; the rest differ by their rounding ("gmm" rounds gate and up to bf16 as the
    forward keeps them, the kernel's sigmoid is not XLA's logistic, and d_s is summed in
    another order)."""
    t = _inputs(*CASES[1])
    args = (t["x"], t["w"], t["w2"], t["w_t"], t["sizes"], t["scale"], t["cotangent"])
    by_gmm = ops.swiglu_mlp_grads(*args, recompute="gmm", interpret=True)
    by_kernel = ops.swiglu_mlp_grads(*args, recompute="kernel", interpret=True)
    chex.assert_trees_all_equal(by_gmm[3], by_kernel[3])
    _assert_close(by_gmm[5], by_kernel[5])
    for i in (0, 1, 2):
        _assert_close(by_gmm[i], by_kernel[i], jnp.bfloat16)
    with pytest.raises(ValueError, match="recompute='xla' must be one of"):
        ops.swiglu_mlp_grads(*args, recompute="xla", interpret=True)
    with pytest.raises(ValueError, match="recompute='xla' must be one of"):
        ops.swiglu_mlp(*args[:5], recompute="xla", interpret=True)


@pytest.mark.slow
def test_swiglu_mlp_grads_take_a_row_scale_of_any_float_dtype():
    """A bf16 row scale is the f32 one it converts to (the kernel wants f32)."""
    t = _inputs(*CASES[1])
    scale = t["scale"].astype(jnp.bfloat16)
    args = (t["x"], t["w"], t["w2"], t["w_t"], t["sizes"])
    grads = ops.swiglu_mlp_grads(*args, scale, t["cotangent"], interpret=True)
    expected = ops.swiglu_mlp_grads(
        *args, scale.astype(jnp.float32), t["cotangent"], interpret=True
    )
    chex.assert_trees_all_equal(grads, expected)


def _shapes_in(jaxpr) -> set[tuple[int, ...]]:
    """The shapes of every value a jaxpr (and each jaxpr inside it) computes."""
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes.update(tuple(v.aval.shape) for v in eqn.outvars)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            shapes |= _shapes_in(sub)
    return shapes


def test_swiglu_mlp_backward_makes_no_gate_up_weight_copies():
    """The backward reads [w_gate | w_up] in two parts and stores [d_w_gate | d_w_up] as two
    arrays: no [G, K, 2F] array (a concatenated weight copy, or a product to slice) exists."""
    t = _inputs(*CASES[0])
    g, k, f = t["w"].shape

    def grads(x, a, b, c):
        def loss(*w):
            y = ops.swiglu_mlp(*w, t["sizes"], row_scale_m=t["scale"], interpret=True)
            return jnp.sum(y * t["cotangent"])

        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, a, b, c)

    shapes = _shapes_in(jax.make_jaxpr(grads)(t["x"], t["w"], t["w2"], t["w_t"]).jaxpr)
    assert (g, k, f) in shapes  # the search sees the weight gradients
    assert (g, k, 2 * f) not in shapes


def test_group_sizes_get_no_gradient():
    t = _inputs(*CASES[1])

    def loss(sizes):
        return jnp.sum(ops.gmm(t["x"], t["w"], sizes, out_dtype=jnp.float32, interpret=True))

    (d_sizes,) = jax.vjp(loss, t["sizes"])[1](jnp.float32(1.0))
    assert d_sizes.dtype == jax.dtypes.float0
    chex.assert_shape(d_sizes, t["sizes"].shape)


def test_weighted_gmm_rejects_what_it_cannot_differentiate():
    t = _inputs(*CASES[1])
    with pytest.raises(ValueError, match="transpose_rhs=False only"):
        ops.gmm(t["x"], t["w"], t["sizes"], row_scale_m=t["scale"], transpose_rhs=True)
    with pytest.raises(ValueError, match="output is float32, got out_dtype=bfloat16"):
        ops.gmm(t["x"], t["w"], t["sizes"], row_scale_m=t["scale"], out_dtype=jnp.bfloat16)
