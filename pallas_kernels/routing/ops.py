"""The router as a differentiable op: the forward kernel (mosaic_gpu.py), and a backward that
computes x's and the router's gradients from the cotangents of the weights, the lse, the score
shares and the logits.

  routed = route(x [T, D], router [D, E], bias [E], spec, chunk=C)

The selection is not differentiable (the experts are integers; the bias only ranks); the
backward differentiates, with the forward's experts held fixed, the reference's function of a
token: logits, scores, the chosen weights (normalized, scaled), lse and score shares (each
share's cotangent is its tile's). It runs over chunks of C tokens (zero-padded, at least two),
so that each token's input gradient comes from products of one fixed shape, the same bits at
any T and on any mesh; the router's gradient is the sum of the chunks' parts in chunk order,
in f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax

from pallas_kernels.mesh import vary, varying_axes
from pallas_kernels.routing import mosaic_gpu, reference
from pallas_kernels.routing.reference import Routed, RouterSpec

MIN_CHUNKS = 2  # XLA inlines a one-step loop, whose fusions may round differently


def route(
    x_td: Array,
    router_de: Array,
    bias_e: Array,
    spec: RouterSpec,
    *,
    chunk: int,
    interpret: bool = False,
) -> Routed:
    """The router's forward kernel, differentiable in x and the router (see the module
    docstring). chunk: C, tokens per step of the backward (fixed by the caller's config, not by
    T). Shapes as `mosaic_gpu.route`'s."""
    if chunk % mosaic_gpu.TILE:
        raise ValueError(f"chunk={chunk} must be a multiple of {mosaic_gpu.TILE} tokens")
    # Inside shard_map the router meets varying tokens: make it vary (its gradient then comes
    # back summed over those axes).
    router_de = vary(router_de, varying_axes(x_td))
    return _route(x_td, router_de, lax.stop_gradient(bias_e), spec, chunk, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _route(x_td, router_de, bias_e, spec, chunk, interpret):
    return mosaic_gpu.route(x_td, router_de, bias_e, spec, interpret=interpret)


def _route_fwd(x_td, router_de, bias_e, spec, chunk, interpret):
    routed = mosaic_gpu.route(x_td, router_de, bias_e, spec, interpret=interpret)
    return routed, (x_td, router_de, bias_e, routed.experts_tk)


def _token_outputs(x_td, router_de, experts_tk, spec: RouterSpec):
    """The differentiable outputs of tokens whose experts are given: (weights [C, K], lse [C],
    shares [C, E], logits [C, E])."""
    logits_te = reference.f32_logits(x_td, router_de)
    scores_te = reference.router_scores(logits_te, spec)
    weights_tk = reference.chosen_weights(scores_te, experts_tk, spec)
    lse_t = jax.nn.logsumexp(logits_te, axis=-1)
    return weights_tk, lse_t, reference.score_shares(scores_te), logits_te


def _chunks(a: Array, chunk: int) -> Array:
    """[T, ...] -> [S, C, ...], zero-padded to S = max(ceil(T / C), MIN_CHUNKS) chunks."""
    steps = max(-(-a.shape[0] // chunk), MIN_CHUNKS)
    a = jnp.pad(a, ((0, steps * chunk - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))
    return a.reshape(steps, chunk, *a.shape[1:])


def _route_bwd(spec, chunk, interpret, residuals, cotangent: Routed):
    del interpret
    x_td, router_de, bias_e, experts_tk = residuals
    num_tokens = x_td.shape[0]
    router = router_de.astype(jnp.float32)
    # A share's cotangent reaches every token of its tile.
    d_shares_te = jnp.repeat(cotangent.shares_ue, mosaic_gpu.TILE, axis=0)[:num_tokens]
    cts = (cotangent.weights_tk, cotangent.lse_t, d_shares_te, cotangent.logits_te)

    def step(d_router_de, args):
        x_cd, experts_ck, *cts_c = args
        _, vjp = jax.vjp(lambda x, w: _token_outputs(x, w, experts_ck, spec), x_cd, router)
        dx_cd, d_router_c = vjp(tuple(cts_c))
        return d_router_de + d_router_c, dx_cd

    xs = tuple(_chunks(a, chunk) for a in (x_td, experts_tk, *cts))
    zeros = vary(jnp.zeros(router.shape, jnp.float32), varying_axes(x_td) | varying_axes(router))
    d_router_de, dx_scd = lax.scan(step, zeros, xs)
    dx_td = dx_scd.reshape(-1, x_td.shape[1])[:num_tokens].astype(x_td.dtype)
    d_router_de = d_router_de.astype(router_de.dtype)
    return dx_td, d_router_de, jnp.zeros_like(bias_e)


_route.defvjp(_route_fwd, _route_bwd)
