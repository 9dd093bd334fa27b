"""The router's spec: scores, group-limited top-k selection and routing weights of T tokens,
and the per-tile sums the router's losses need.

  logits   x(f32) @ router(f32)                                    [T, D] x [D, E] -> [T, E] f32
  scores   softmax(logits) or sigmoid(logits)                                        [T, E] f32
  experts  the K best of scores + bias, best first, ties to the lower index; with groups,
           only among the experts of the `topk_groups` best groups (a group's score: the sum
           of its two best biased scores; ties to the lower group)                   [T, K] int32
  weights  the chosen experts' unbiased scores, divided by their sum when norm_topk_prob
           (a sum that underflowed to 0 leaves them 0), times routed_scaling          [T, K] f32
  lse      logsumexp(logits), for the z-loss                                          [T] f32
  counts   rows routed to each expert by the tokens of each tile of `tile` tokens    [U, E] int32
  shares   the sum over each tile's tokens of scores / sum(scores), for the
           load-balancing loss                                                       [U, E] f32

The functions below are the layer's routing (`mok_jax.routing` calls them with its config) and
the oracle of the routing kernel (mosaic_gpu.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import Array, lax

ScoreFn = Literal["softmax", "sigmoid"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterSpec:
    """What the router computes (hashable; `mok_jax.MoEConfig` has the same fields).

    Attributes:
      num_experts: E.
      top_k: K, experts per token (1 <= K <= E, and within the eligible groups' experts).
      score_fn: "softmax" or "sigmoid" over the logits.
      norm_topk_prob: divide the chosen weights by their sum.
      routed_scaling: factor on the weights after normalization.
      num_groups, topk_groups: group-limited selection (both None: off). E divides into
        num_groups groups of at least 2 experts; topk_groups of them stay eligible.
    """

    num_experts: int
    top_k: int
    score_fn: ScoreFn = "softmax"
    norm_topk_prob: bool = False
    routed_scaling: float = 1.0
    num_groups: int | None = None
    topk_groups: int | None = None

    def __post_init__(self) -> None:
        e, k = self.num_experts, self.top_k
        if not 1 <= k <= e:
            raise ValueError(f"top_k={k} must be in [1, num_experts={e}]")
        if self.score_fn not in ("softmax", "sigmoid"):
            raise ValueError(f"score_fn={self.score_fn!r} must be 'softmax' or 'sigmoid'")
        if (self.num_groups is None) != (self.topk_groups is None):
            raise ValueError("num_groups and topk_groups must be set together")
        if self.num_groups is not None:
            g, kg = self.num_groups, self.topk_groups
            if g < 1 or e % g or e // g < 2:
                raise ValueError(f"num_groups={g} must split {e} experts into groups of >= 2")
            if not 1 <= kg <= g or kg * (e // g) < k:
                raise ValueError(
                    f"topk_groups={kg} of {g} groups must hold at least top_k={k} experts"
                )

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // (self.num_groups or 1)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["experts_tk", "weights_tk", "logits_te", "lse_t", "counts_ue", "shares_ue"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Routed:
    """The router's outputs for T tokens in U tiles (see the module docstring)."""

    experts_tk: Array
    weights_tk: Array
    logits_te: Array
    lse_t: Array
    counts_ue: Array
    shares_ue: Array


def router_scores(logits_te: Array, spec: RouterSpec) -> Array:
    """f32 [T, E]: softmax or sigmoid of the logits f32 [T, E]."""
    if spec.score_fn == "softmax":
        return jax.nn.softmax(logits_te, axis=-1)
    return jax.nn.sigmoid(logits_te)


def top_k_indices(values: Array, k: int) -> Array:
    """int32 [..., k]: indices of the k largest values along the last axis, largest first, ties
    to the lower index, on every backend.

    `lax.top_k` promises the same, but XLA may hand it to GPU kernels that do not keep it (see
    openxla/xla#43913); a two-key sort (value descending, then index) states the order itself.
    """
    iota = lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)
    _, indices = lax.sort((-values, iota), dimension=values.ndim - 1, num_keys=2)
    return indices[..., :k]


def eligible_experts(biased_te: Array, spec: RouterSpec) -> Array:
    """bool [T, E]: the experts of each token's `topk_groups` best groups."""
    num_tokens = biased_te.shape[0]
    grouped_tgp = biased_te.reshape(num_tokens, spec.num_groups, spec.experts_per_group)
    best_two = lax.top_k(grouped_tgp, 2)[0]
    group_score_tg = best_two[..., 0] + best_two[..., 1]
    chosen_groups = top_k_indices(group_score_tg, spec.topk_groups)
    group_mask_tg = jnp.any(chosen_groups[..., None] == jnp.arange(spec.num_groups), axis=1)
    return jnp.repeat(group_mask_tg, spec.experts_per_group, axis=1)


def select_experts(scores_te: Array, bias_e: Array, spec: RouterSpec) -> Array:
    """int32 [T, K]: the K best experts by biased score, best first, ties to the lower index."""
    biased_te = lax.stop_gradient(scores_te + bias_e.astype(jnp.float32))
    if spec.num_groups is not None:
        biased_te = jnp.where(eligible_experts(biased_te, spec), biased_te, -jnp.inf)
    return top_k_indices(biased_te, spec.top_k)


def chosen_weights(scores_te: Array, experts_tk: Array, spec: RouterSpec) -> Array:
    """f32 [T, K]: each chosen expert's unbiased score, normalized and scaled.

    A dense one-hot selection, not a gather: a gather's gradient is a scatter-add, which is not
    bitwise repeatable on GPU. Each sum over E has one nonzero term, so it is exact.
    """
    onehot_tke = experts_tk[..., None] == jnp.arange(spec.num_experts)
    weights_tk = jnp.sum(jnp.where(onehot_tke, scores_te[:, None, :], 0.0), axis=-1)
    if spec.norm_topk_prob:
        weights_tk = normalized(weights_tk)
    return weights_tk * spec.routed_scaling


def normalized(weights_tk: Array) -> Array:
    """[T, K]: each token's weights divided by their sum; a token whose chosen sigmoid scores
    all underflowed to 0 keeps weights 0 (not 0/0 = NaN), with a finite gradient."""
    total_t1 = jnp.sum(weights_tk, axis=-1, keepdims=True)
    positive_t1 = total_t1 > 0
    # Dividing by 1 where the sum is 0 keeps NaN out of the untaken branch's gradient too.
    return jnp.where(positive_t1, weights_tk / jnp.where(positive_t1, total_t1, 1.0), 0.0)


def score_shares(scores_te: Array) -> Array:
    """f32 [T, E]: each token's scores normalized to sum to 1 (a token-wise quantity)."""
    return scores_te / jnp.sum(scores_te, axis=-1, keepdims=True)


def f32_logits(x_td: Array, router_de: Array) -> Array:
    """[T, D] x [D, E] -> f32 [T, E] at full f32 precision (no TF32) on every backend."""
    return jnp.dot(
        x_td.astype(jnp.float32), router_de.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )


def tile_sums(values_te: Array, tile: int) -> Array:
    """[T, E] -> [ceil(T / tile), E]: the sum over each tile's tokens (zero-padded)."""
    num_tokens, width = values_te.shape
    tiles = -(-num_tokens // tile)
    padded = jnp.pad(values_te, ((0, tiles * tile - num_tokens), (0, 0)))
    return jnp.sum(padded.reshape(tiles, tile, width), axis=1)


def route(x_td: Array, router_de: Array, bias_e: Array, spec: RouterSpec, *, tile: int) -> Routed:
    """The router on T tokens x [T, D] with weights router [D, E] and bias [E] -> `Routed`,
    its per-tile sums over tiles of `tile` tokens."""
    logits_te = f32_logits(x_td, router_de)
    scores_te = router_scores(logits_te, spec)
    experts_tk = select_experts(scores_te, bias_e, spec)
    onehot_te = jnp.any(experts_tk[..., None] == jnp.arange(spec.num_experts), axis=1)
    return Routed(
        experts_tk=experts_tk,
        weights_tk=chosen_weights(scores_te, experts_tk, spec),
        logits_te=logits_te,
        lse_t=jax.nn.logsumexp(logits_te, axis=-1),
        counts_ue=tile_sums(onehot_te.astype(jnp.int32), tile),
        shares_ue=tile_sums(score_shares(scores_te), tile),
    )
