"""The router as a differentiable op: the forward kernel and the backward kernel
(mosaic_gpu.py), and the router weights' gradient.

  routed = route(x [T, D], router [D, E], bias [E], spec)

The selection is not differentiable (the experts are integers; the bias only ranks). The
backward kernel recomputes each tile's logits as the forward did and, with the forward's experts,
forms d_logits from the cotangents of the weights, the lse and the tile sums of the score
shares, then dx = d_logits @ router^T: a program per tile of 64 tokens, so a token's dx is the
same bits at any T and on any mesh. The logits are returned without a gradient (the losses
read the lse). The router's gradient is x^T @ d_logits in blocks of ROUTER_GRAD_BLOCK tokens,
added in block order in f32 (`router_weight_grad`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax

from pallas_kernels.mesh import vary, varying_axes
from pallas_kernels.routing import mosaic_gpu, reference
from pallas_kernels.routing.reference import Routed, RouterSpec

# Rows of a block of the router weights' gradient. Over a whole token chunk that gradient is
# one [D, C] x [C, E] product with a handful of output tiles and a K of C, which a GPU runs on a
# few SMs (0.57 ms for a chunk of 16,384 tokens at D 1024, E 64 on an H100: 8% of the `gpu`
# training preset's step); as a batch of [D, B] x [B, E] products it has C / B times the tiles,
# and their sum runs in a fixed order.
ROUTER_GRAD_BLOCK = 1024


def router_weight_grad(x_td: Array, router_de: Array, d_logits_te: Array) -> Array:
    """The router weights' gradient x^T @ d_logits, f32 [D, E], at full f32 precision.

    Up to ROUTER_GRAD_BLOCK tokens, or a count that is not a multiple of it: autodiff's
    transposed dot, bit for bit. Else the sum over consecutive blocks of ROUTER_GRAD_BLOCK
    tokens of each block's autodiff gradient, added in block order. router_de (f32, its values
    unused) gives the gradient's shape and, inside shard_map, the mesh axes it varies over."""

    def grad_de(x_td, d_logits_te):
        return jax.vjp(lambda w: reference.f32_logits(x_td, w), router_de)[1](d_logits_te)[0]

    num_tokens = x_td.shape[0]
    blocks = num_tokens // ROUTER_GRAD_BLOCK
    if blocks <= 1 or num_tokens % ROUTER_GRAD_BLOCK:
        return grad_de(x_td, d_logits_te)
    x_btd = x_td.reshape(blocks, ROUTER_GRAD_BLOCK, x_td.shape[1])
    d_bte = d_logits_te.reshape(blocks, ROUTER_GRAD_BLOCK, d_logits_te.shape[1])
    parts_bde = jax.vmap(grad_de)(x_btd, d_bte)
    total_de = parts_bde[0]
    for b in range(1, blocks):
        total_de = total_de + parts_bde[b]
    return total_de


def route(
    x_td: Array, router_de: Array, bias_e: Array, spec: RouterSpec, *, interpret: bool = False
) -> Routed:
    """The router's forward kernel, differentiable in x and the router through the weights,
    the lse and the share sums (see the module docstring). Shapes as `mosaic_gpu.route`'s."""
    # Inside shard_map the router meets varying tokens: make it vary (its gradient then comes
    # back summed over those axes).
    router_de = vary(router_de, varying_axes(x_td))
    routed = _route(x_td, router_de, lax.stop_gradient(bias_e), spec, interpret)
    return Routed(
        experts_tk=routed.experts_tk,
        weights_tk=routed.weights_tk,
        logits_te=lax.stop_gradient(routed.logits_te),
        lse_t=routed.lse_t,
        counts_ue=routed.counts_ue,
        shares_ue=routed.shares_ue,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _route(x_td, router_de, bias_e, spec, interpret):
    return mosaic_gpu.route(x_td, router_de, bias_e, spec, interpret=interpret)


def _route_fwd(x_td, router_de, bias_e, spec, interpret):
    routed = mosaic_gpu.route(x_td, router_de, bias_e, spec, interpret=interpret)
    return routed, (x_td, router_de, bias_e, routed.experts_tk)


def _route_bwd(spec, interpret, residuals, cotangent: Routed):
    x_td, router_de, bias_e, experts_tk = residuals
    cts = (cotangent.weights_tk, cotangent.lse_t, cotangent.shares_ue)
    dx_td, d_logits_te = mosaic_gpu.route_backward(
        x_td, router_de, experts_tk, cts, spec, interpret=interpret
    )
    # Zero tokens up to whole blocks (they add exact zeros): the blocked product at any T.
    num_tokens = x_td.shape[0]
    padded = -(-num_tokens // ROUTER_GRAD_BLOCK) * ROUTER_GRAD_BLOCK
    pad = ((0, padded - num_tokens), (0, 0))
    d_router_de = router_weight_grad(
        jnp.pad(x_td, pad), router_de.astype(jnp.float32), jnp.pad(d_logits_te, pad)
    )
    return dx_td, d_router_de.astype(router_de.dtype), jnp.zeros_like(bias_e)


_route.defvjp(_route_fwd, _route_bwd)
