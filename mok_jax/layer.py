"""The MoE layer as a function: `moe(x, params, cfg) -> (y, aux)`.

The `xla` implementation is a sequence of short named stages (each under `jax.named_scope`, so a
profile reads like this file):

  route     logits, scores, top-k experts and weights               [T, D] -> [T, K]
  plan      stable sort of the N = T*K rows by expert; group sizes  [T, K] -> Plan
  dispatch  gather each row's token into expert-sorted order         [T, D] -> [N, D]
  experts   SwiGLU grouped GEMMs (`jax.lax.ragged_dot`)              [N, D] -> [N, D] f32
  combine   rows back to (token, slot) order; fixed-order weighted sum plus the shared experts

On one device nothing travels, so there is no return stage between experts and combine.
Every step is deterministic: no scatter-add on the forward or backward path (see permute.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from mok_jax.config import MoEConfig
from mok_jax.experts import dense_swiglu, grouped_swiglu_ragged
from mok_jax.params import MoEParams, validate_params
from mok_jax.permute import rows_to_slots, sum_slots, tokens_to_rows
from mok_jax.plan import Plan, make_plan
from mok_jax.reference import moe_reference
from mok_jax.routing import MoEAux, Routing, load_balancing_loss, route, router_z_loss


def _route(x_td: Array, params: MoEParams, cfg: MoEConfig) -> Routing:
    with jax.named_scope("route"):
        return route(x_td, params.router, params.router_bias, cfg)


def _plan(routing: Routing, cfg: MoEConfig) -> Plan:
    with jax.named_scope("plan"):
        num_tokens = routing.experts_tk.shape[0]
        return make_plan(routing.experts_tk, cfg.num_experts, cfg.capacity(num_tokens))


def _dispatch(x_td: Array, plan: Plan, cfg: MoEConfig) -> Array:
    with jax.named_scope("dispatch"):
        return tokens_to_rows(x_td.astype(cfg.dtype), plan.order_n, plan.inverse_n, cfg.top_k)


def _experts(x_nd: Array, params: MoEParams, plan: Plan, cfg: MoEConfig) -> Array:
    with jax.named_scope("experts"):
        return grouped_swiglu_ragged(
            x_nd, params.w_gate, params.w_up, params.w_down, plan.group_sizes_e, cfg.dtype
        )


def _combine(
    y_nd: Array, x_td: Array, routing: Routing, plan: Plan, params: MoEParams, cfg: MoEConfig
) -> Array:
    """y[t] = sum_j w[t, j] * y[t, j] in slot order (f32), plus the shared experts."""
    with jax.named_scope("combine"):
        num_tokens, top_k = routing.weights_tk.shape
        y_tkd = rows_to_slots(y_nd, plan.order_n, plan.inverse_n).reshape(num_tokens, top_k, -1)
        terms_tkd = routing.weights_tk[..., None] * y_tkd
        if plan.keep_n is not None:
            terms_tkd = jnp.where(plan.keep_n.reshape(num_tokens, top_k, 1), terms_tkd, 0.0)
        y_td = sum_slots(terms_tkd)
        if cfg.num_shared_experts:
            y_td = y_td + dense_swiglu(
                x_td, params.shared_w_gate, params.shared_w_up, params.shared_w_down, cfg.dtype
            )
        return y_td.astype(x_td.dtype)


def _aux(routing: Routing, plan: Plan, cfg: MoEConfig) -> MoEAux:
    with jax.named_scope("aux"):
        return MoEAux(
            aux_loss=load_balancing_loss(routing.scores_te, plan.group_sizes_e, cfg),
            z_loss=router_z_loss(routing.logits_te, cfg),
            tokens_per_expert=plan.group_sizes_e,
            dropped=plan.dropped,
        )


def moe_xla(x_td: Array, params: MoEParams, cfg: MoEConfig) -> tuple[Array, MoEAux]:
    """The `xla` implementation on x [T, D] (already validated)."""
    routing = _route(x_td, params, cfg)
    plan = _plan(routing, cfg)
    x_nd = _dispatch(x_td, plan, cfg)
    y_nd = _experts(x_nd, params, plan, cfg)
    return _combine(y_nd, x_td, routing, plan, params, cfg), _aux(routing, plan, cfg)


_IMPLEMENTATIONS: dict[str, Callable[[Array, MoEParams, MoEConfig], tuple[Array, MoEAux]]] = {
    "reference": moe_reference,
    "xla": moe_xla,
}


def _check_input(x: jax.typing.ArrayLike, cfg: MoEConfig) -> Array:
    if not isinstance(cfg, MoEConfig):
        raise ValueError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"x must have a floating dtype, got {dtype}: cast it yourself, the layer does not guess"
        )
    shape = jnp.shape(x)
    if len(shape) == 0 or shape[-1] != cfg.d_model:
        raise ValueError(f"x has shape {shape}; its last dimension must be d_model={cfg.d_model}")
    return jnp.asarray(x)


def _no_tokens(x: Array, cfg: MoEConfig) -> tuple[Array, MoEAux]:
    zero_f32 = jnp.zeros((), jnp.float32)
    return x, MoEAux(
        aux_loss=zero_f32,
        z_loss=zero_f32,
        tokens_per_expert=jnp.zeros((cfg.num_experts,), jnp.int32),
        dropped=jnp.zeros((), jnp.int32),
    )


def moe(x: jax.typing.ArrayLike, params: MoEParams, cfg: MoEConfig) -> tuple[Array, MoEAux]:
    """Applies a Mixture-of-Experts layer (top-k routing, SwiGLU experts, weighted combine).

    Deterministic: the same inputs give the same bits, run after run. Dropless unless
    `cfg.capacity_factor` is set. Differentiable in `x` and every parameter but `router_bias`.

    Args:
      x: [..., D] tokens, any float dtype; every leading dimension is a token dimension (T is
        their product). Computed in `cfg.dtype` with f32 accumulation.
      params: `MoEParams` with the shapes of `cfg` (see `init_params`).
      cfg: the layer's `MoEConfig` (static: hashable, pass it as a static jit argument).

    Returns:
      (y, aux): y [..., D] with x's shape and dtype; aux a `MoEAux` with the load-balancing and
      z losses (f32 scalars, coefficients applied), tokens_per_expert int32 [E] and dropped
      int32 [].

    Raises:
      ValueError: x is not floating or its last dimension is not D, or params do not fit cfg.

    Example:
      >>> cfg = mok_jax.presets["tiny"]
      >>> params = mok_jax.init_params(jax.random.key(0), cfg)
      >>> y, aux = jax.jit(mok_jax.moe, static_argnames="cfg")(jnp.ones((4, 16, 64)), params,
      ...                                                     cfg=cfg)
      >>> y.shape, aux.tokens_per_expert.sum()
      ((4, 16, 64), Array(128, dtype=int32))
    """
    x = _check_input(x, cfg)
    validate_params(params, cfg)
    num_tokens = math.prod(x.shape[:-1])
    if num_tokens == 0:
        return _no_tokens(x, cfg)
    x_td = x.reshape(num_tokens, cfg.d_model)
    y_td, aux = _IMPLEMENTATIONS[cfg.implementation](x_td, params, cfg)
    return y_td.reshape(x.shape), aux
