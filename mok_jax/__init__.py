"""mok-jax: deterministic, dropless Mixture-of-Experts layers for JAX."""

from mok_jax.config import (
    EXCHANGES,
    IMPLEMENTATIONS,
    PRESETS,
    Exchange,
    Implementation,
    MoEConfig,
    ScoreFn,
    scale_down,
)
from mok_jax.determinism import compiler_options, deterministic_compiler_options
from mok_jax.hf import from_hf
from mok_jax.layer import moe
from mok_jax.mesh import LAYOUTS, Layout, ShardingRules, make_mesh
from mok_jax.module import MoE, RouterBias
from mok_jax.options import MoEOptions, Target, current_target, gpu_target, targeting
from mok_jax.params import MoEParams, init_params
from mok_jax.resolve import Resolution, resolve, resolve_implementation
from mok_jax.routing import MoEAux, update_router_bias

presets = PRESETS

__all__ = [
    "EXCHANGES",
    "IMPLEMENTATIONS",
    "LAYOUTS",
    "Exchange",
    "Implementation",
    "Layout",
    "MoE",
    "MoEAux",
    "MoEConfig",
    "MoEOptions",
    "MoEParams",
    "Resolution",
    "RouterBias",
    "ScoreFn",
    "ShardingRules",
    "Target",
    "compiler_options",
    "current_target",
    "deterministic_compiler_options",
    "from_hf",
    "gpu_target",
    "init_params",
    "make_mesh",
    "moe",
    "presets",
    "resolve",
    "resolve_implementation",
    "scale_down",
    "targeting",
    "update_router_bias",
]
