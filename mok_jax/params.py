"""The MoE layer's parameters: a pytree dataclass, its initializer and its shape check."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array

from mok_jax.config import MoEConfig, canonical_dtype


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "router",
        "router_bias",
        "w_gate",
        "w_up",
        "w_down",
        "shared_w_gate",
        "shared_w_up",
        "shared_w_down",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class MoEParams:
    """Weights of one MoE layer (a pytree). Any float dtype; the layer casts to `cfg.dtype`.

    Attributes:
      router: [D, E] router weight; logits = x @ router, in f32.
      router_bias: [E] selection bias for auxiliary-loss-free balancing: it shifts which experts
        are chosen, never the weights, and gets no gradient (see `update_router_bias`).
      w_gate: [E, D, F] gate projection of each expert's SwiGLU.
      w_up: [E, D, F] up projection.
      w_down: [E, F, D] down projection.
      shared_w_gate: [D, S*F] the shared experts' gate projection, or None when S = 0.
      shared_w_up: [D, S*F], or None.
      shared_w_down: [S*F, D], or None.
    """

    router: Array
    router_bias: Array
    w_gate: Array
    w_up: Array
    w_down: Array
    shared_w_gate: Array | None = None
    shared_w_up: Array | None = None
    shared_w_down: Array | None = None


def expected_shapes(cfg: MoEConfig) -> dict[str, tuple[int, ...] | None]:
    """The shape of every `MoEParams` field under `cfg` (None: the field must be None)."""
    d, e, f, sf = cfg.d_model, cfg.num_experts, cfg.d_ff, cfg.shared_width
    shared = cfg.num_shared_experts > 0
    return {
        "router": (d, e),
        "router_bias": (e,),
        "w_gate": (e, d, f),
        "w_up": (e, d, f),
        "w_down": (e, f, d),
        "shared_w_gate": (d, sf) if shared else None,
        "shared_w_up": (d, sf) if shared else None,
        "shared_w_down": (sf, d) if shared else None,
    }


def validate_params(params: MoEParams, cfg: MoEConfig) -> None:
    """Raises `ValueError` listing every field whose shape or dtype does not fit `cfg`."""
    if not isinstance(params, MoEParams):
        raise ValueError(f"params must be a MoEParams, got {type(params).__name__}")
    problems = []
    for name, shape in expected_shapes(cfg).items():
        value = getattr(params, name)
        if shape is None:
            if value is not None:
                problems.append(
                    f"{name} must be None with num_shared_experts=0, got shape {jnp.shape(value)}"
                )
            continue
        if value is None:
            problems.append(
                f"{name} is None but num_shared_experts="
                f"{cfg.num_shared_experts} needs shape {shape}"
            )
        elif jnp.shape(value) != shape:
            problems.append(f"{name} has shape {jnp.shape(value)}, expected {shape}")
        elif not jnp.issubdtype(jnp.result_type(value), jnp.floating):
            problems.append(f"{name} has dtype {jnp.result_type(value)}, expected a float dtype")
    if problems:
        raise ValueError(
            "MoEParams do not match the config "
            f"(D={cfg.d_model}, F={cfg.d_ff}, E={cfg.num_experts}, "
            f"S={cfg.num_shared_experts}): " + "; ".join(problems)
        )


def init_params(
    key: Array, cfg: MoEConfig, *, dtype: jax.typing.DTypeLike = jnp.float32
) -> MoEParams:
    """Fresh parameters for `cfg`: truncated-normal fan-in init, zero router bias.

    Args:
      key: a PRNG key.
      cfg: the layer's config.
      dtype: the parameters' storage dtype (f32 by default; the compute dtype is `cfg.dtype`).

    Returns:
      `MoEParams` with the shapes of `expected_shapes(cfg)`.

    Example:
      >>> params = init_params(jax.random.key(0), PRESETS["tiny"])
      >>> params.w_gate.shape
      (8, 64, 128)
    """
    dtype = canonical_dtype(dtype)
    d, f, sf = cfg.d_model, cfg.d_ff, cfg.shared_width
    fan_in = functools.partial(
        jax.nn.initializers.variance_scaling, 1.0, "fan_in", "truncated_normal", dtype=dtype
    )
    expert_init = fan_in(in_axis=-2, out_axis=-1, batch_axis=(0,))
    dense_init = fan_in(in_axis=-2, out_axis=-1)
    keys = jax.random.split(key, 7)
    shared = cfg.num_shared_experts > 0
    return MoEParams(
        router=dense_init(keys[0], (d, cfg.num_experts)),
        router_bias=jnp.zeros((cfg.num_experts,), dtype),
        w_gate=expert_init(keys[1], (cfg.num_experts, d, f)),
        w_up=expert_init(keys[2], (cfg.num_experts, d, f)),
        w_down=expert_init(keys[3], (cfg.num_experts, f, d)),
        shared_w_gate=dense_init(keys[4], (d, sf)) if shared else None,
        shared_w_up=dense_init(keys[5], (d, sf)) if shared else None,
        shared_w_down=dense_init(keys[6], (sf, d)) if shared else None,
    )
