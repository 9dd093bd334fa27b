"""The oracle: the MoE layer written for obviousness, not speed. Every other implementation is
tested against it, so it shares no routing, planning or combine code with them.

It runs every expert on every token (`lax.map` over experts: E times the FLOPs of the real
layer), picks experts by repeated argmax, counts capacity ranks with a cumulative sum and reads
each token's expert outputs with a gather. It is meant for small shapes on one device, and it
is an oracle, not a training path: the gradients of its gathers are scatter-adds, so on GPU its
backward is not bitwise repeatable (the determinism tests hold the other implementations).

The one thing it must share with the others bit for bit is the router logits (the same f32
product at full precision): expert selection is discontinuous, so logits that differ in the
last bit could pick different experts and make a comparison meaningless.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array, lax

from mok_jax.config import MoEConfig
from mok_jax.params import MoEParams
from mok_jax.routing import MoEAux


def _argmax_top_k(values_te: Array, k: int) -> Array:
    """int32 [T, k]: the k largest entries per row, largest first, ties to the lower index."""
    chosen = []
    for _ in range(k):
        best_t = jnp.argmax(values_te, axis=-1)  # argmax returns the first of equal maxima
        chosen.append(best_t)
        taken_te = jnp.arange(values_te.shape[-1]) == best_t[:, None]
        values_te = jnp.where(taken_te, -jnp.inf, values_te)
    return jnp.stack(chosen, axis=1).astype(jnp.int32)


def _select(scores_te: Array, bias_e: Array, cfg: MoEConfig) -> Array:
    biased_te = lax.stop_gradient(scores_te + bias_e.astype(jnp.float32))
    if cfg.num_groups is not None:
        num_tokens = scores_te.shape[0]
        grouped = biased_te.reshape(num_tokens, cfg.num_groups, -1)
        ascending = jnp.sort(grouped, axis=-1)
        group_score_tg = ascending[..., -1] + ascending[..., -2]
        groups_tg = _argmax_top_k(group_score_tg, cfg.topk_groups)
        group_of_e = jnp.arange(cfg.num_experts) // (cfg.num_experts // cfg.num_groups)
        eligible_te = jnp.any(group_of_e[None, None, :] == groups_tg[:, :, None], axis=1)
        biased_te = jnp.where(eligible_te, biased_te, -jnp.inf)
    return _argmax_top_k(biased_te, cfg.top_k)


def _capacity_keep(experts_tk: Array, cfg: MoEConfig) -> Array | None:
    """bool [T, K]: whether each (token, slot) is among its expert's first C in pair order."""
    capacity = cfg.capacity(experts_tk.shape[0])
    if capacity is None:
        return None
    onehot_ne = (experts_tk.reshape(-1)[:, None] == jnp.arange(cfg.num_experts)).astype(jnp.int32)
    seen_ne = jnp.cumsum(onehot_ne, axis=0)  # rows of each expert up to and including n
    rank_n = jnp.sum(seen_ne * onehot_ne, axis=1) - 1
    return (rank_n < capacity).reshape(experts_tk.shape)


def _swiglu(x_td: Array, w_gate: Array, w_up: Array, w_down: Array, cfg: MoEConfig) -> Array:
    dtype = cfg.dtype
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def mm(a, b):
        return jnp.matmul(
            a.astype(dtype),
            b.astype(dtype),
            precision=precision,
            preferred_element_type=jnp.float32,
        )

    gate, up = mm(x_td, w_gate), mm(x_td, w_up)
    return mm(gate * jax.nn.sigmoid(gate) * up, w_down)


def moe_reference(x_td: Array, params: MoEParams, cfg: MoEConfig) -> tuple[Array, MoEAux]:
    """The MoE layer on x [T, D] -> (y [T, D] in x's dtype, `MoEAux`). Unsharded."""
    num_tokens, num_experts = x_td.shape[0], cfg.num_experts
    logits_te = jnp.dot(
        x_td.astype(jnp.float32), params.router.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )
    if cfg.score_fn == "softmax":
        scores_te = jax.nn.softmax(logits_te, axis=-1)
    else:
        scores_te = jax.nn.sigmoid(logits_te)
    experts_tk = _select(scores_te, params.router_bias, cfg)
    weights_tk = jnp.take_along_axis(scores_te, experts_tk, axis=1)
    if cfg.norm_topk_prob:  # chosen sigmoid scores that all underflowed to 0 stay 0
        total_t1 = jnp.sum(weights_tk, axis=1, keepdims=True)
        safe_t1 = jnp.where(total_t1 > 0, total_t1, 1.0)
        weights_tk = jnp.where(total_t1 > 0, weights_tk / safe_t1, 0.0)
    weights_tk = weights_tk * cfg.routed_scaling

    # Every expert on every token: out_etd[e, t] is expert e's output for token t.
    out_etd = lax.map(lambda w: _swiglu(x_td, *w, cfg), (params.w_gate, params.w_up, params.w_down))
    keep_tk = _capacity_keep(experts_tk, cfg)
    y_td = jnp.zeros((num_tokens, cfg.d_model), jnp.float32)
    for j in range(cfg.top_k):
        term_td = weights_tk[:, j, None] * out_etd[experts_tk[:, j], jnp.arange(num_tokens)]
        if keep_tk is not None:
            term_td = jnp.where(keep_tk[:, j, None], term_td, 0.0)
        y_td = y_td + term_td
    if cfg.num_shared_experts:
        y_td = y_td + _swiglu(
            x_td, params.shared_w_gate, params.shared_w_up, params.shared_w_down, cfg
        )

    counts_e = jnp.sum(
        experts_tk[..., None] == jnp.arange(num_experts), axis=(0, 1), dtype=jnp.int32
    )
    probs_e = jnp.mean(scores_te / jnp.sum(scores_te, axis=1, keepdims=True), axis=0)
    fraction_e = counts_e.astype(jnp.float32) / (num_tokens * cfg.top_k)
    aux = MoEAux(
        aux_loss=cfg.aux_loss_coef * num_experts * jnp.sum(fraction_e * probs_e),
        z_loss=cfg.z_loss_coef * jnp.mean(jax.nn.logsumexp(logits_te, axis=1) ** 2),
        tokens_per_expert=counts_e,
        dropped=(
            jnp.zeros((), jnp.int32) if keep_tk is None else jnp.sum(~keep_tk, dtype=jnp.int32)
        ),
        rounds=jnp.ones((), jnp.int32),
    )
    return y_td.astype(x_td.dtype), aux
