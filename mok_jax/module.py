"""The MoE layer as a Flax NNX module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from mok_jax.config import MoEConfig
from mok_jax.layer import moe
from mok_jax.params import MoEParams, init_params
from mok_jax.routing import MoEAux, update_router_bias


class RouterBias(nnx.Variable):
    """The router's selection bias: state, not a trained parameter (`nnx.Param` filters skip it;
    `MoE.update_router_bias` moves it)."""


class MoE(nnx.Module):
    """A Mixture-of-Experts layer holding its parameters; `__call__(x)` returns `(y, aux)`.

    Args:
      cfg: the layer's `MoEConfig`.
      rngs: `nnx.Rngs` whose `params` stream initializes the weights.
      param_dtype: the parameters' storage dtype (f32 by default).

    Example:
      >>> layer = MoE(mok_jax.presets["tiny"], rngs=nnx.Rngs(0))
      >>> y, aux = layer(jnp.ones((2, 8, 64)))
      >>> y.shape, aux.tokens_per_expert.shape
      ((2, 8, 64), (8,))
    """

    def __init__(
        self, cfg: MoEConfig, *, rngs: nnx.Rngs, param_dtype: jax.typing.DTypeLike = jnp.float32
    ):
        params = init_params(rngs.params(), cfg, dtype=param_dtype)
        self.cfg = cfg
        self.router = nnx.Param(params.router)
        self.router_bias = RouterBias(params.router_bias)
        self.w_gate = nnx.Param(params.w_gate)
        self.w_up = nnx.Param(params.w_up)
        self.w_down = nnx.Param(params.w_down)
        shared = cfg.num_shared_experts > 0
        self.shared_w_gate = nnx.Param(params.shared_w_gate) if shared else None
        self.shared_w_up = nnx.Param(params.shared_w_up) if shared else None
        self.shared_w_down = nnx.Param(params.shared_w_down) if shared else None

    @property
    def params(self) -> MoEParams:
        """The current weights as `MoEParams` (for `mok_jax.moe` or a checkpoint)."""

        def value(variable):
            return None if variable is None else variable[...]

        return MoEParams(
            router=value(self.router),
            router_bias=value(self.router_bias),
            w_gate=value(self.w_gate),
            w_up=value(self.w_up),
            w_down=value(self.w_down),
            shared_w_gate=value(self.shared_w_gate),
            shared_w_up=value(self.shared_w_up),
            shared_w_down=value(self.shared_w_down),
        )

    def __call__(self, x: Array) -> tuple[Array, MoEAux]:
        """x [..., D] -> (y [..., D] in x's dtype, `MoEAux`); see `mok_jax.moe`."""
        return moe(x, self.params, self.cfg)

    def update_router_bias(self, tokens_per_expert: Array, rate: float) -> None:
        """Moves the selection bias towards balance (see `mok_jax.update_router_bias`)."""
        self.router_bias[...] = update_router_bias(self.router_bias[...], tokens_per_expert, rate)
