"""Routing: router logits and scores, expert selection, routing weights and the router losses.

Semantics (the same in every implementation):
  1. logits = x(f32) @ router(f32); scores = softmax(logits) or sigmoid(logits).
  2. Selection ranks scores + router_bias. With groups, a group's score is the sum of its two best
     biased scores and only the best `topk_groups` groups stay eligible. Ties go to the lower
     index, for groups and for experts; slot j holds the j-th best expert.
  3. Weights are the unbiased scores of the chosen experts, divided by their sum when
     `norm_topk_prob` (a sum that underflowed to 0 leaves them 0), then times
     `routed_scaling`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array, lax

from mok_jax.config import MoEConfig
from pallas_kernels.mesh import vary, varying_axes
from pallas_kernels.routing import reference
from pallas_kernels.routing.ops import ROUTER_GRAD_BLOCK as ROUTER_GRAD_BLOCK
from pallas_kernels.routing.ops import router_weight_grad
from pallas_kernels.routing.reference import normalized as normalized
from pallas_kernels.routing.reference import score_shares
from pallas_kernels.routing.reference import top_k_indices as top_k_indices


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["experts_tk", "weights_tk", "logits_te", "scores_te"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Routing:
    """Where each token goes. experts_tk int32 [T, K] (best first); weights_tk f32 [T, K];
    logits_te and scores_te f32 [T, E]."""

    experts_tk: Array
    weights_tk: Array
    logits_te: Array
    scores_te: Array


def router_logits(x_td: Array, router_de: Array) -> Array:
    """[T, D] x [D, E] -> f32 [T, E], at full f32 precision (no TF32) on every backend.

    Its gradient keeps x in its own dtype and converts it again in the backward (conversion to
    f32 is exact), where autodiff would keep the f32 copy: 4 bytes a value of x (8 KiB a token
    at D = 2048, most of the `fused` layer's residuals) become the 2 the layer keeps anyway.
    x's gradient is autodiff's, bit for bit; the router's is `router_weight_grad`'s."""
    # Inside shard_map the router weights meet varying tokens: make them vary (their gradient
    # then comes back summed over those axes), as autodiff's implicit cast would.
    return _router_logits(x_td, vary(router_de, varying_axes(x_td)))


_f32_dot = reference.f32_logits


@jax.custom_vjp
def _router_logits(x_td: Array, router_de: Array) -> Array:
    return _f32_dot(x_td, router_de)


def _router_logits_fwd(x_td, router_de):
    return _f32_dot(x_td, router_de), (x_td, router_de)


def _router_logits_bwd(residuals, d_logits_te):
    x_td, router_de = residuals
    # d_x: autodiff's transposed dot and casts (its unused d_router is dropped by XLA).
    d_x_td = jax.vjp(_f32_dot, x_td, router_de)[1](d_logits_te)[0]
    d_router_de = router_weight_grad(x_td, router_de.astype(jnp.float32), d_logits_te)
    return d_x_td, d_router_de.astype(router_de.dtype)


_router_logits.defvjp(_router_logits_fwd, _router_logits_bwd)


def router_scores(logits_te: Array, cfg: MoEConfig) -> Array:
    """f32 [T, E]: softmax or sigmoid of the logits (`reference.router_scores`)."""
    return reference.router_scores(logits_te, cfg.router_spec)


def select_experts(scores_te: Array, bias_e: Array, cfg: MoEConfig) -> Array:
    """int32 [T, K]: the K best experts by biased score, best first, ties to the lower index,
    within the eligible groups (`reference.select_experts`)."""
    return reference.select_experts(scores_te, bias_e, cfg.router_spec)


def chosen_weights(scores_te: Array, experts_tk: Array, cfg: MoEConfig) -> Array:
    """f32 [T, K]: each chosen expert's unbiased score, normalized and scaled
    (`reference.chosen_weights`)."""
    return reference.chosen_weights(scores_te, experts_tk, cfg.router_spec)


def route(x_td: Array, router_de: Array, bias_e: Array, cfg: MoEConfig) -> Routing:
    """Routes T tokens: x [T, D] -> `Routing` (experts and weights [T, K], logits and scores)."""
    return route_logits(router_logits(x_td, router_de), bias_e, cfg)


def route_logits(logits_te: Array, bias_e: Array, cfg: MoEConfig) -> Routing:
    """Routes T tokens from their router logits f32 [T, E]."""
    scores_te = router_scores(logits_te, cfg)
    experts_tk = select_experts(scores_te, bias_e, cfg)
    return Routing(
        experts_tk=experts_tk,
        weights_tk=chosen_weights(scores_te, experts_tk, cfg),
        logits_te=logits_te,
        scores_te=scores_te,
    )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["aux_loss", "z_loss", "tokens_per_expert", "dropped", "rounds"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class MoEAux:
    """What an MoE layer reports besides its output (a pytree).

    Attributes:
      aux_loss: f32 [] the load-balancing loss, already times `aux_loss_coef`.
      z_loss: f32 [] the router z-loss, already times `z_loss_coef`.
      tokens_per_expert: int32 [E] rows routed to each expert, counted before any capacity drop.
      dropped: int32 [] (token, slot) rows dropped by the capacity; 0 when dropless.
      rounds: int32 [] rounds of the expert-parallel exchange (1 when the receive buffers held
        every row; more under imbalance; 0 without tokens).
    """

    aux_loss: Array
    z_loss: Array
    tokens_per_expert: Array
    dropped: Array
    rounds: Array

    @property
    def loss(self) -> Array:
        """aux_loss + z_loss: what to add to the training loss."""
        return self.aux_loss + self.z_loss


def _token_mean(values_t: Array, axes: tuple[str, ...]) -> Array:
    """The mean over the tokens of every device on `axes` (this device's alone when none)."""
    if not axes:
        return jnp.mean(values_t, axis=0)
    total = lax.psum(jnp.sum(values_t, axis=0), axes)
    return total / (values_t.shape[0] * lax.axis_size(axes))


def load_balancing_loss(
    scores_te: Array,
    tokens_per_expert_e: Array,
    cfg: MoEConfig,
    axes: tuple[str, ...] = (),
    *,
    shares_te: Array | None = None,
    share_sums_e: Array | None = None,
) -> Array:
    """coef * E * sum_e f_e * P_e (f32 []): f_e the share of the T*K routed slots sent to e, P_e
    the mean over tokens of the scores normalized to sum to 1 per token (`score_shares`, or
    `shares_te` when given, or from `share_sums_e`, their sum over this device's tokens). Under
    shard_map, the tokens are those of every device on `axes` and tokens_per_expert_e must be
    global."""
    if shares_te is not None and share_sums_e is not None:
        raise ValueError("give shares_te or share_sums_e, not both")
    if cfg.aux_loss_coef == 0:
        return jnp.zeros((), jnp.float32)
    devices = lax.axis_size(axes) if axes else 1
    num_slots = scores_te.shape[0] * cfg.top_k * devices
    f_e = tokens_per_expert_e.astype(jnp.float32) / num_slots
    if share_sums_e is not None:
        total_e = lax.psum(share_sums_e, axes) if axes else share_sums_e
        p_e = total_e / (scores_te.shape[0] * devices)
    else:
        p_e = _token_mean(score_shares(scores_te) if shares_te is None else shares_te, axes)
    return cfg.aux_loss_coef * cfg.num_experts * jnp.sum(f_e * p_e)


def router_z_loss(
    logits_te: Array, cfg: MoEConfig, axes: tuple[str, ...] = (), *, lse_t: Array | None = None
) -> Array:
    """coef * mean_t(logsumexp(logits_t)^2) (f32 []), over the tokens of every device on
    `axes` under shard_map (`lse_t`: the logsumexps, when already computed)."""
    if cfg.z_loss_coef == 0:
        return jnp.zeros((), jnp.float32)
    lse_t = jax.nn.logsumexp(logits_te, axis=-1) if lse_t is None else lse_t
    return cfg.z_loss_coef * _token_mean(lse_t**2, axes)


def update_router_bias(bias: Array, tokens_per_expert: Array, rate: float) -> Array:
    """Auxiliary-loss-free balancing (DeepSeek-V3): bias += rate * sign(mean load - load).

    Args:
      bias: [E] the current `MoEParams.router_bias`.
      tokens_per_expert: [E] int the load of the last step (`MoEAux.tokens_per_expert`).
      rate: the update speed (DeepSeek-V3 used 0.001).

    Returns:
      The new bias, [E], in `bias`'s dtype: overloaded experts are pushed down, idle ones up.

    Example:
      >>> update_router_bias(jnp.zeros(4), jnp.array([6, 2, 0, 0]), 0.1)
      Array([-0.1,  0.1,  0.1,  0.1], dtype=float32)
    """
    if jnp.shape(bias) != jnp.shape(tokens_per_expert) or jnp.ndim(bias) != 1:
        raise ValueError(
            f"bias {jnp.shape(bias)} and tokens_per_expert "
            f"{jnp.shape(tokens_per_expert)} must both have shape [E]"
        )
    load_e = jnp.asarray(tokens_per_expert).astype(jnp.float32)
    step_e = rate * jnp.sign(jnp.mean(load_e) - load_e)
    return (jnp.asarray(bias).astype(jnp.float32) + step_e).astype(jnp.result_type(bias))
