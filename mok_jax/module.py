"""The MoE layer as a Flax NNX module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from mok_jax.config import MoEConfig
from mok_jax.layer import moe
from mok_jax.mesh import PARAM_AXES, ShardingRules
from mok_jax.params import MoEParams, init_params
from mok_jax.routing import MoEAux, update_router_bias


class RouterBias(nnx.Variable):
    """The router's selection bias: state, not a trained parameter (`nnx.Param` filters skip it;
    `MoE.update_router_bias` moves it)."""


class MoE(nnx.Module):
    """A Mixture-of-Experts layer holding its parameters; `__call__(x)` returns `(y, aux)`.

    Expert parallel under `jax.set_mesh(mesh)` (a mesh from `make_mesh`): the call runs the
    layer inside `shard_map` over that mesh. Every variable carries its `out_sharding` from
    `rules` (experts over `expert`, the rest replicated), so `nnx.get_partition_spec` and
    `nnx.get_named_sharding` give the shardings for a jitted training step; created under such
    a mesh, the variables are placed on it at once.

    Args:
      cfg: the layer's `MoEConfig`.
      rngs: `nnx.Rngs` whose `params` stream initializes the weights.
      param_dtype: the parameters' storage dtype (f32 by default).
      rules: the `ShardingRules` (default: tokens over ("data", "expert"), experts over
        "expert").

    Example:
      >>> layer = MoE(mok_jax.presets["tiny"], rngs=nnx.Rngs(0))
      >>> y, aux = layer(jnp.ones((2, 8, 64)))
      >>> y.shape, aux.tokens_per_expert.shape
      ((2, 8, 64), (8,))
    """

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rules: ShardingRules | None = None,
    ):
        params = init_params(rngs.params(), cfg, dtype=param_dtype)
        self.cfg = cfg
        self.rules = ShardingRules() if rules is None else rules
        mesh = jax.sharding.get_abstract_mesh()
        eager = not mesh.empty and set(self.rules.tokens) <= set(mesh.axis_names)

        def variable(kind, field):
            value = getattr(params, field)
            if value is None:
                return None
            spec = tuple(self.rules.spec(*PARAM_AXES[field]))
            return kind(value, out_sharding=spec, eager_sharding=eager)

        self.router = variable(nnx.Param, "router")
        self.router_bias = variable(RouterBias, "router_bias")
        self.w_gate = variable(nnx.Param, "w_gate")
        self.w_up = variable(nnx.Param, "w_up")
        self.w_down = variable(nnx.Param, "w_down")
        self.shared_w_gate = variable(nnx.Param, "shared_w_gate")
        self.shared_w_up = variable(nnx.Param, "shared_w_up")
        self.shared_w_down = variable(nnx.Param, "shared_w_down")

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
        return moe(x, self.params, self.cfg, rules=self.rules)

    def update_router_bias(self, tokens_per_expert: Array, rate: float) -> None:
        """Moves the selection bias towards balance (see `mok_jax.update_router_bias`)."""
        self.router_bias[...] = update_router_bias(self.router_bias[...], tokens_per_expert, rate)
