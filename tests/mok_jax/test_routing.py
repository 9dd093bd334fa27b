"""Routing: selection rules (ties, groups, bias) as properties, weights, losses, bias updates."""

from __future__ import annotations

import dataclasses

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mok_jax import MoEConfig, routing, update_router_bias
from mok_jax.routing import (
    chosen_weights,
    load_balancing_loss,
    route,
    router_logits,
    router_z_loss,
    select_experts,
    top_k_indices,
)


def ranked(row: np.ndarray) -> list[int]:
    """Indices by descending value, ties to the lower index: the selection rule, in numpy."""
    return sorted(range(len(row)), key=lambda i: (-row[i], i))


@st.composite
def tied_scores(draw, max_tokens=6, max_experts=12):
    """Scores from a handful of values, so ties are everywhere."""
    num_experts = draw(st.integers(2, max_experts))
    num_tokens = draw(st.integers(1, max_tokens))
    levels = st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0])
    return draw(hnp.arrays(np.float32, (num_tokens, num_experts), elements=levels))


@given(scores=tied_scores(), data=st.data())
def test_top_k_ties_go_to_the_lower_index(scores, data):
    k = data.draw(st.integers(1, scores.shape[1]))
    got = np.asarray(top_k_indices(jnp.asarray(scores), k))
    for t, row in enumerate(scores):
        assert list(got[t]) == ranked(row)[:k]


@given(scores=tied_scores(max_experts=16), data=st.data())
def test_group_limited_selection(scores, data):
    num_tokens, num_experts = scores.shape
    divisors = [g for g in range(1, num_experts // 2 + 1) if num_experts % g == 0]
    num_groups = data.draw(st.sampled_from(divisors))
    topk_groups = data.draw(st.integers(1, num_groups))
    per_group = num_experts // num_groups
    top_k = data.draw(st.integers(1, topk_groups * per_group))
    bias = data.draw(
        hnp.arrays(np.float32, (num_experts,), elements=st.sampled_from([0.0, 0.25, -0.25]))
    )
    cfg = MoEConfig(
        d_model=8,
        d_ff=8,
        num_experts=num_experts,
        top_k=top_k,
        num_groups=num_groups,
        topk_groups=topk_groups,
    )
    got = np.asarray(select_experts(jnp.asarray(scores), jnp.asarray(bias), cfg))
    for t in range(num_tokens):
        biased = scores[t] + bias
        groups = biased.reshape(num_groups, per_group)
        group_score = [sum(sorted(g)[-2:][::-1]) for g in groups]
        kept = ranked(np.array(group_score))[:topk_groups]
        eligible = [e for e in ranked(biased) if e // per_group in kept]
        assert list(got[t]) == eligible[:top_k]


@given(scores=tied_scores(), data=st.data())
def test_weights_are_unbiased_scores(scores, data):
    num_experts = scores.shape[1]
    top_k = data.draw(st.integers(1, num_experts))
    norm = data.draw(st.booleans())
    scaling = data.draw(st.sampled_from([1.0, 2.5]))
    cfg = MoEConfig(
        d_model=8,
        d_ff=8,
        num_experts=num_experts,
        top_k=top_k,
        norm_topk_prob=norm,
        routed_scaling=scaling,
    )
    bias = np.linspace(-0.3, 0.3, num_experts, dtype=np.float32)
    experts = select_experts(jnp.asarray(scores), jnp.asarray(bias), cfg)
    weights = np.asarray(chosen_weights(jnp.asarray(scores), experts, cfg))
    expected = np.take_along_axis(scores, np.asarray(experts), axis=1)
    if norm:  # a row whose chosen scores are all 0 keeps weights 0
        total = expected.sum(axis=1, keepdims=True)
        expected = np.divide(expected, total, out=np.zeros_like(expected), where=total > 0)
    np.testing.assert_allclose(weights, expected * scaling, rtol=1e-6)


def test_every_token_gets_k_distinct_experts():
    cfg = MoEConfig(d_model=16, d_ff=64, num_experts=16, top_k=4, num_groups=4, topk_groups=2)
    x = jax.random.normal(jax.random.key(0), (50, 16))
    router = jax.random.normal(jax.random.key(1), (16, 16))
    routing = route(x, router, jnp.zeros(16), cfg)
    chex.assert_shape(routing.experts_tk, (50, 4))
    chex.assert_type(routing.experts_tk, jnp.int32)
    for row in np.asarray(routing.experts_tk):
        assert len(set(row)) == 4 and len({e // 4 for e in row}) <= 2


def test_softmax_and_sigmoid_scores():
    x = jax.random.normal(jax.random.key(0), (5, 8))
    router = jax.random.normal(jax.random.key(1), (8, 6))
    logits = x @ router
    for score_fn, expected in (
        ("softmax", jax.nn.softmax(logits)),
        ("sigmoid", jax.nn.sigmoid(logits)),
    ):
        cfg = MoEConfig(d_model=8, d_ff=8, num_experts=6, top_k=2, score_fn=score_fn)
        routing = route(x, router, jnp.zeros(6), cfg)
        chex.assert_trees_all_close(routing.scores_te, expected, rtol=1e-5)


def test_bias_changes_the_choice_not_the_weights():
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=1, score_fn="sigmoid")
    scores = jnp.array([[0.9, 0.1, 0.2, 0.3]])
    experts = select_experts(scores, jnp.array([0.0, 0.0, 1.0, 0.0]), cfg)
    assert int(experts[0, 0]) == 2
    chex.assert_trees_all_close(chosen_weights(scores, experts, cfg), jnp.array([[0.2]]))


def test_losses():
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=2, top_k=1, aux_loss_coef=0.5, z_loss_coef=0.1)
    scores = jnp.array([[0.75, 0.25], [0.5, 0.5]])
    counts = jnp.array([2, 0])
    # f = (1, 0); P = (0.625, 0.375) -> 0.5 * 2 * 0.625
    chex.assert_trees_all_close(load_balancing_loss(scores, counts, cfg), 0.625)
    logits = jnp.array([[0.0, 0.0], [1.0, 1.0]])
    z = 0.1 * np.mean(np.log([2.0, 2 * np.e]) ** 2)
    chex.assert_trees_all_close(router_z_loss(logits, cfg), z, rtol=1e-6)
    off = dataclasses.replace(cfg, aux_loss_coef=0.0, z_loss_coef=0.0)
    assert float(load_balancing_loss(scores, counts, off)) == 0.0
    assert float(router_z_loss(logits, off)) == 0.0


def test_update_router_bias():
    bias = jnp.array([0.0, 0.5, -0.5, 0.0], jnp.float32)
    new = update_router_bias(bias, jnp.array([10, 2, 2, 2], jnp.int32), 0.01)
    chex.assert_trees_all_close(new, jnp.array([-0.01, 0.51, -0.49, 0.01]))
    chex.assert_type(new, jnp.float32)
    balanced = update_router_bias(bias, jnp.array([3, 3, 3, 3]), 0.01)
    chex.assert_trees_all_equal(balanced, bias)
    with pytest.raises(ValueError, match="must both have shape"):
        update_router_bias(bias, jnp.array([1, 2, 3]), 0.01)


def test_normalized_weights_of_underflowed_scores_stay_zero():
    cfg = MoEConfig(
        d_model=8, d_ff=8, num_experts=4, top_k=2, score_fn="sigmoid", norm_topk_prob=True
    )
    x = jnp.ones((3, 8))
    router = jnp.full((8, 4), -20.0)  # logits -160: sigmoid underflows to exactly 0 in f32

    def total_weight(router):
        return jnp.sum(route(x, router, jnp.zeros(4), cfg).weights_tk)

    chex.assert_trees_all_equal(route(x, router, jnp.zeros(4), cfg).weights_tk, jnp.zeros((3, 2)))
    chex.assert_tree_all_finite(jax.grad(total_weight)(router))


@pytest.mark.parametrize("blocks", [2, 3])
def test_router_weight_gradient_adds_its_token_blocks_in_order(blocks):
    """Over whole blocks of ROUTER_GRAD_BLOCK tokens, the router's gradient is the sum of each
    block's autodiff gradient in block order (bits), which is f32-close to one long dot's."""
    rows = blocks * routing.ROUTER_GRAD_BLOCK
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (rows, 32), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (32, 8), jnp.float32).astype(jnp.bfloat16)
    g = jax.random.normal(keys[2], (rows, 8), jnp.float32)

    def plain(x, w):
        return jnp.dot(
            x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
        )

    def w_grad_f32(x, g):
        return jax.vjp(lambda w32: plain(x, w32), w.astype(jnp.float32))[1](g)[0]

    _, vjp = jax.vjp(router_logits, x, w)
    dx, dw = jax.jit(vjp)(g)
    block = routing.ROUTER_GRAD_BLOCK
    parts = [jax.jit(w_grad_f32)(x[b * block : (b + 1) * block], g[b * block : (b + 1) * block])
             for b in range(blocks)]  # fmt: skip
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    chex.assert_trees_all_equal(dw, total.astype(w.dtype))
    chex.assert_trees_all_close(
        jax.jit(w_grad_f32)(x, g), total, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(total)))
    )
    chex.assert_trees_all_equal(dx, jax.jit(jax.vjp(plain, x, w)[1])(g)[0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_router_logits_gradients_are_autodiffs_without_an_f32_copy_of_x(dtype):
    """The custom VJP gives autodiff's gradients bit for bit, and saves x in its own dtype (no
    f32 [T, D] copy among the residuals for bf16 x)."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (37, 64), jnp.float32).astype(dtype)
    w = jax.random.normal(keys[1], (64, 16), jnp.float32).astype(dtype)
    g = jax.random.normal(keys[2], (37, 16), jnp.float32)

    def plain(x, w):
        return jnp.dot(
            x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
        )

    out, vjp = jax.vjp(router_logits, x, w)
    plain_out, plain_vjp = jax.vjp(plain, x, w)
    chex.assert_trees_all_equal(out, plain_out)
    chex.assert_trees_all_equal(jax.jit(vjp)(g), jax.jit(plain_vjp)(g))
    # The VJP closure's leaves are the residuals it keeps.
    kept = [(a.shape, a.dtype) for a in jax.tree.leaves(vjp)]
    assert (x.shape, jnp.dtype(dtype)) in kept
    if dtype == jnp.bfloat16:
        assert (x.shape, jnp.dtype(jnp.float32)) not in kept
        assert (x.shape, jnp.dtype(jnp.float32)) in [
            (a.shape, a.dtype) for a in jax.tree.leaves(plain_vjp)
        ]
