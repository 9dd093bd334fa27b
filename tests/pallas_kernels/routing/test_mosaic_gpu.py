"""The router's forward kernel (pallas_kernels/routing/mosaic_gpu.py): its invariants, its edge
cases and its bad inputs, in GPU interpret mode on the CPU. The kernel against the reference at
small and real sizes, lowered for CUDA and on a GPU, is a row of test_contracts.py's table;
`assert_routed_matches` is that row's check."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.routing import mosaic_gpu, reference
from pallas_kernels.routing.reference import RouterSpec
from pallas_kernels.tolerances import tolerance

BF16, F32 = jnp.bfloat16, jnp.float32
TILE = mosaic_gpu.TILE
# Two biased scores closer than this (relative to the larger) may be ranked either way by two
# f32 computations of the logits in different orders.
NEAR_TIE = 1e-5


def inputs(num_tokens: int, d: int, num_experts: int, seed: int = 0, bias_scale: float = 0.01):
    """x bf16 [T, D], router f32 [D, E] (logits of order 1), bias f32 [E]."""
    kx, kw, kb = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (num_tokens, d), F32).astype(BF16)
    router = jax.random.normal(kw, (d, num_experts), F32) / np.sqrt(d)
    bias = jax.random.normal(kb, (num_experts,), F32) * bias_scale
    return x, router, bias


def _clear_ranking(want: reference.Routed, bias, spec: RouterSpec) -> np.ndarray:
    """bool [T]: tokens whose reference selection has no near tie: each chosen biased score
    stands NEAR_TIE clear of the next, the K-th of the best unchosen eligible one, and every
    group score of the group step of the next group's."""
    scores = np.asarray(reference.router_scores(want.logits_te, spec))
    biased = scores + np.asarray(bias, np.float32)
    experts = np.asarray(want.experts_tk)
    chosen = np.take_along_axis(biased, experts, axis=1)
    rest = biased.copy()
    np.put_along_axis(rest, experts, -np.inf, axis=1)
    if spec.num_groups is not None:
        eligible = np.asarray(reference.eligible_experts(jnp.asarray(biased), spec))
        rest = np.where(eligible, rest, -np.inf)
        grouped = np.sort(biased.reshape(len(biased), spec.num_groups, -1), axis=2)
        group_scores = np.sort(grouped[..., -1] + grouped[..., -2], axis=1)[:, ::-1]
        kg = spec.topk_groups
        group_gaps = np.diff(-group_scores[:, : kg + 1], axis=1) if kg < spec.num_groups else None
    ranked = np.concatenate([chosen, rest.max(axis=1, keepdims=True)], axis=1)
    gaps = -np.diff(ranked, axis=1)
    scale = np.maximum(np.abs(ranked[:, :-1]), 1e-30)
    clear = np.all(gaps > NEAR_TIE * scale, axis=1)
    if spec.num_groups is not None and group_gaps is not None:
        clear &= np.all(group_gaps > NEAR_TIE * np.maximum(np.abs(group_scores[:, :kg]), 1), axis=1)
    return clear


def assert_routed_matches(got: reference.Routed, want: reference.Routed, bias, spec) -> None:
    """got is the reference's routing: experts equal on every token without a near tie (at most
    5% of the tokens may have one, so that the check checks), their weights, the logits, lse
    and shares within f32's tolerance, the counts equal where no token of the tile has a near
    tie."""
    clear = _clear_ranking(want, bias, spec)
    assert clear.mean() >= 0.95, f"{(~clear).sum()} of {clear.size} tokens have near ties"
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    np.testing.assert_array_equal(
        np.asarray(got.experts_tk)[clear], np.asarray(want.experts_tk)[clear]
    )
    tol = tolerance(F32)
    for field, rows in (("weights_tk", clear), ("logits_te", None), ("lse_t", None)):
        g, w = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
        if rows is not None:
            g, w = g[rows], w[rows]
        np.testing.assert_allclose(g, w, rtol=tol.rtol, atol=tol.scaled_atol(w), err_msg=field)
    # A tile's share of an expert sums TILE tokens' shares: TILE roundings of f32.
    shares = np.asarray(want.shares_ue)
    np.testing.assert_allclose(
        np.asarray(got.shares_ue), shares, rtol=tol.rtol, atol=tol.scaled_atol(shares) * TILE
    )
    padded = np.pad(clear, (0, len(want.counts_ue) * TILE - clear.size), constant_values=True)
    clear_tiles = padded.reshape(-1, TILE).all(axis=1)
    np.testing.assert_array_equal(
        np.asarray(got.counts_ue)[clear_tiles], np.asarray(want.counts_ue)[clear_tiles]
    )


def _route(x, router, bias, spec) -> reference.Routed:
    return mosaic_gpu.route(x, router, bias, spec, interpret=True)


# ---------------------------------------------------------------------------------------------
# Invariant 1: the router's pieces hold its f32 values.


def test_router_pieces_sum_to_the_router():
    w = jax.random.normal(jax.random.key(0), (128, 64), F32)
    w = w * jnp.logspace(-6, 3, 64, dtype=F32)  # magnitudes far apart, all in bf16's normal range
    pieces = mosaic_gpu.router_pieces(w, 128)
    chex.assert_type(pieces, BF16)
    chex.assert_shape(pieces, (mosaic_gpu.PIECES, 128, 128))
    total = pieces[0].astype(F32) + pieces[1].astype(F32) + pieces[2].astype(F32)
    chex.assert_trees_all_equal(total[:, :64], w)
    chex.assert_trees_all_equal(pieces[:, :, 64:], jnp.zeros((3, 128, 64), BF16))


# ---------------------------------------------------------------------------------------------
# Invariant 2: a token's results do not depend on its tile or on T.


def test_a_tokens_bits_do_not_depend_on_its_tile_or_the_token_count():
    spec = RouterSpec(num_experts=64, top_k=4)
    x, router, bias = inputs(150, 128, 64, seed=3)
    whole = _route(x, router, bias, spec)
    shifted = _route(jnp.concatenate([x[:7], x]), router, bias, spec)  # every token 7 rows on
    part = _route(x[100:], router, bias, spec)  # the last 50 tokens alone, in one tile
    for field in ("experts_tk", "weights_tk", "logits_te", "lse_t"):
        chex.assert_trees_all_equal(getattr(shifted, field)[7:], getattr(whole, field))
        chex.assert_trees_all_equal(getattr(part, field), getattr(whole, field)[100:])


# ---------------------------------------------------------------------------------------------
# Invariant 3: the selection rule, ties included.

SPECS = {
    "softmax": RouterSpec(num_experts=64, top_k=4),
    "k1": RouterSpec(num_experts=16, top_k=1),
    "k_equals_e": RouterSpec(num_experts=8, top_k=8, norm_topk_prob=True),
    "sigmoid_norm_scaled": RouterSpec(
        num_experts=96, top_k=6, score_fn="sigmoid", norm_topk_prob=True, routed_scaling=2.5
    ),
    "groups": RouterSpec(
        num_experts=64,
        top_k=4,
        score_fn="sigmoid",
        norm_topk_prob=True,
        num_groups=8,
        topk_groups=3,
    ),
    "e_above_128": RouterSpec(num_experts=160, top_k=8),
}


# The fast tier runs the specs that exercise the most (groups, sigmoid, normalization, k = E).
FAST_SPECS = ("groups", "k_equals_e", "sigmoid_norm_scaled")


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if n in FAST_SPECS else pytest.mark.slow) for n in SPECS],
)
def test_interpret_mode_matches_the_reference(name):
    spec = SPECS[name]
    x, router, bias = inputs(100, 128, spec.num_experts, seed=1)
    got = _route(x, router, bias, spec)
    assert_routed_matches(got, reference.route(x, router, bias, spec, tile=TILE), bias, spec)


def test_equal_scores_go_to_the_lower_experts():
    spec = RouterSpec(num_experts=16, top_k=4)
    x = jnp.zeros((TILE, 64), BF16)  # every logit 0: every score ties
    router = jax.random.normal(jax.random.key(0), (64, 16), F32)
    bias = jnp.zeros(16, F32).at[jnp.array([9, 3])].set(0.5)  # two experts above the rest
    got = _route(x, router, bias, spec)
    chex.assert_trees_all_equal(got.experts_tk, jnp.tile(jnp.array([3, 9, 0, 1]), (TILE, 1)))
    chex.assert_trees_all_close(got.weights_tk, jnp.full((TILE, 4), 1 / 16, F32))
    want = jnp.zeros(16, jnp.int32).at[jnp.array([0, 1, 3, 9])].set(TILE)
    chex.assert_trees_all_equal(got.counts_ue, want[None])


def test_equal_group_scores_go_to_the_lower_groups():
    spec = RouterSpec(num_experts=16, top_k=2, num_groups=4, topk_groups=1)
    x = jnp.zeros((8, 64), BF16)
    # Groups 1 and 3 tie above groups 0 and 2: group 1's experts only.
    bias = jnp.zeros(16, F32).at[jnp.array([4, 5, 12, 13])].set(0.25)
    got = _route(x, jnp.zeros((64, 16), F32), bias, spec)
    chex.assert_trees_all_equal(got.experts_tk, jnp.tile(jnp.array([4, 5]), (8, 1)))
    bias = bias.at[14].set(0.25)  # group 3 now scores the same but holds a third such expert
    got = _route(x, jnp.zeros((64, 16), F32), bias, spec)
    chex.assert_trees_all_equal(got.experts_tk, jnp.tile(jnp.array([4, 5]), (8, 1)))


# ---------------------------------------------------------------------------------------------
# Invariant 5 and the padding: sums over the real tokens only.


@pytest.mark.parametrize("num_tokens", [1, TILE - 1, TILE + 1])
def test_sums_count_the_real_tokens_only(num_tokens):
    spec = RouterSpec(num_experts=32, top_k=3)
    x, router, bias = inputs(num_tokens, 64, 32, seed=2)
    got = _route(x, router, bias, spec)
    assert int(got.counts_ue.sum()) == num_tokens * 3
    chex.assert_trees_all_close(got.shares_ue.sum(), jnp.float32(num_tokens), rtol=1e-5)
    assert_routed_matches(got, reference.route(x, router, bias, spec, tile=TILE), bias, spec)


# ---------------------------------------------------------------------------------------------
# Bad inputs.


@pytest.mark.parametrize(
    ("x_shape", "x_dtype", "num_experts", "match"),
    [
        ((8, 64), F32, 8, "bf16"),
        ((8, 96), BF16, 8, "multiple of"),
        ((8, 64), BF16, 320, "at most"),
        ((0, 64), BF16, 8, "no tokens"),
    ],
)
def test_bad_inputs_raise(x_shape, x_dtype, num_experts, match):
    spec = RouterSpec(num_experts=num_experts, top_k=2)
    x = jnp.zeros(x_shape, x_dtype)
    router = jnp.zeros((x_shape[1], num_experts), F32)
    with pytest.raises(ValueError, match=match):
        mosaic_gpu.route(x, router, jnp.zeros(num_experts, F32), spec, interpret=True)


def test_router_of_the_wrong_shape_raises():
    spec = RouterSpec(num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=r"\[D, E\]"):
        mosaic_gpu.route(jnp.zeros((8, 64), BF16), jnp.zeros((64, 9)), jnp.zeros(8), spec)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(num_experts=8, top_k=9), "top_k"),
        (dict(num_experts=8, top_k=2, num_groups=4), "together"),
        (dict(num_experts=8, top_k=2, num_groups=8, topk_groups=1), "groups of >= 2"),
        (dict(num_experts=8, top_k=5, num_groups=4, topk_groups=2), "at least top_k"),
        (dict(num_experts=8, top_k=2, score_fn="relu"), "score_fn"),
    ],
)
def test_bad_specs_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        RouterSpec(**fields)
