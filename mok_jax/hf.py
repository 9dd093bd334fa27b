"""Weight import from Hugging Face MoE blocks: Mixtral, Qwen3-MoE and DeepSeek-V3 layouts.

Two weight layouts are understood, for one MoE block (keys relative to the block, or give
`prefix`):
  - fused, as transformers >= 5 holds them in memory: `gate.weight` [E, D],
    `experts.gate_up_proj` [E, 2F, D] (gate rows first), `experts.down_proj` [E, D, F];
  - per expert, as checkpoints on the Hub store them: `experts.{e}.gate_proj.weight` [F, D],
    `experts.{e}.up_proj.weight`, `experts.{e}.down_proj.weight` [D, F] (Mixtral: `w1` gate,
    `w3` up, `w2` down).
Plus DeepSeek-V3's `gate.e_score_correction_bias` [E] and shared experts
`shared_experts.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from jax import Array

from mok_jax.config import MoEConfig, canonical_dtype
from mok_jax.params import MoEParams, validate_params

HFLayout = typing.Literal["mixtral", "qwen3_moe", "deepseek_v3"]
HF_LAYOUTS: tuple[str, ...] = typing.get_args(HFLayout)


def _config_dict(hf_config: typing.Any) -> dict[str, typing.Any]:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise ValueError(
        "hf_config must be a transformers PretrainedConfig or a dict, got "
        f"{type(hf_config).__name__}"
    )


def _required(conf: Mapping[str, typing.Any], *names: str) -> typing.Any:
    for name in names:
        if conf.get(name) is not None:
            return conf[name]
    raise ValueError(f"the Hugging Face config has none of {names}")


def moe_config_from_hf(hf_config: typing.Any, **overrides: typing.Any) -> MoEConfig:
    """The `MoEConfig` of a Hugging Face Mixtral / Qwen3-MoE / DeepSeek-V3 config.

    `overrides` replace fields afterwards (e.g. `dtype`, `implementation`, `capacity_factor`).
    Fields that shape the layer's function must be present: a missing one raises `ValueError`
    rather than take a default that may not be transformers' (DeepSeek-V3's `n_group`, ...).
    """
    conf = _config_dict(hf_config)
    layout = conf.get("model_type")
    if layout not in HF_LAYOUTS:
        raise ValueError(f"model_type={layout!r} is not one of the supported layouts {HF_LAYOUTS}")
    if conf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act={conf['hidden_act']!r}: mok_jax experts are SwiGLU (silu)")
    common = dict(
        d_model=_required(conf, "hidden_size"),
        top_k=_required(conf, "num_experts_per_tok"),
        aux_loss_coef=float(conf.get("router_aux_loss_coef") or 0.0),
    )
    if layout == "mixtral":
        fields = dict(
            d_ff=_required(conf, "intermediate_size"),
            num_experts=_required(conf, "num_local_experts"),
            norm_topk_prob=True,
        )
    elif layout == "qwen3_moe":
        fields = dict(
            d_ff=_required(conf, "moe_intermediate_size"),
            num_experts=_required(conf, "num_experts", "num_local_experts"),
            norm_topk_prob=bool(conf.get("norm_topk_prob", False)),
        )
    else:
        fields = dict(
            d_ff=_required(conf, "moe_intermediate_size"),
            num_experts=_required(conf, "n_routed_experts", "num_local_experts"),
            score_fn="sigmoid",
            norm_topk_prob=bool(conf.get("norm_topk_prob", True)),
            routed_scaling=float(_required(conf, "routed_scaling_factor")),
            num_groups=_required(conf, "n_group"),
            topk_groups=_required(conf, "topk_group"),
            num_shared_experts=_required(conf, "n_shared_experts"),
            aux_loss_coef=0.0,
        )
    cfg = MoEConfig(**{**common, **fields})
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def _to_array(value: typing.Any, param_dtype: np.dtype | None) -> Array:
    """A torch tensor, numpy array or jax array -> a jax array (torch without importing it)."""
    if hasattr(value, "detach"):  # a torch tensor; bf16 has no numpy dtype
        source = canonical_dtype(str(value.dtype).removeprefix("torch."))
        value = jnp.asarray(value.detach().cpu().float().numpy()).astype(source)
    array = jnp.asarray(value)
    return array if param_dtype is None else array.astype(param_dtype)


def _take(
    block: Mapping[str, typing.Any],
    key: str,
    shape: tuple[int, ...],
    *,
    prefix: str,
    param_dtype: np.dtype | None,
) -> Array:
    """block[key] as a jax array, after checking that it is there and has `shape` (the shape
    transformers gives it; a square matrix's orientation cannot be checked)."""
    if key not in block:
        raise ValueError(f"missing {prefix + key!r} among the weights (wrong prefix or layout?)")
    got = tuple(block[key].shape)
    if got != shape:
        raise ValueError(f"{prefix + key!r} has shape {got}, expected {shape}")
    return _to_array(block[key], param_dtype)


def _expert_weights(
    take: typing.Callable[[str, tuple[int, ...]], Array],
    block: Mapping[str, typing.Any],
    cfg: MoEConfig,
    layout: str,
) -> tuple[Array, Array, Array]:
    """(w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D]) from either layout."""
    e, d, f = cfg.num_experts, cfg.d_model, cfg.d_ff
    if "experts.gate_up_proj" in block:
        gate_up_efd = take("experts.gate_up_proj", (e, 2 * f, d))  # gate rows first
        down_edf = take("experts.down_proj", (e, d, f))
        return (
            jnp.swapaxes(gate_up_efd[:, :f], 1, 2),
            jnp.swapaxes(gate_up_efd[:, f:], 1, 2),
            jnp.swapaxes(down_edf, 1, 2),
        )
    names = ("w1", "w3", "w2") if layout == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    shapes = ((f, d), (f, d), (d, f))
    w_gate, w_up, w_down = (
        jnp.swapaxes(jnp.stack([take(f"experts.{i}.{name}.weight", shape) for i in range(e)]), 1, 2)
        for name, shape in zip(names, shapes, strict=True)
    )
    return w_gate, w_up, w_down


def from_hf(
    weights: Mapping[str, typing.Any],
    hf_config: typing.Any,
    *,
    prefix: str = "",
    param_dtype: typing.Any = None,
    **overrides: typing.Any,
) -> tuple[MoEParams, MoEConfig]:
    """Turns one Hugging Face MoE block's weights into `MoEParams` and their `MoEConfig`.

    Every weight of the block must be used: a missing, unexpected or misshapen one raises
    `ValueError` naming it.

    Args:
      weights: the block's tensors by name (torch tensors, numpy or jax arrays), e.g.
        `block.state_dict()`, or a whole model's state dict together with `prefix`.
      hf_config: the model's transformers config (or its `to_dict()`); its `model_type` picks
        the layout: "mixtral", "qwen3_moe" or "deepseek_v3".
      prefix: the block's key prefix, e.g. "model.layers.3.mlp." (a trailing dot is added).
      param_dtype: the dtype to store the expert weights in; None keeps the checkpoint's. The
        router weight and bias are always float32.
      **overrides: `MoEConfig` fields to set, e.g. `dtype=jnp.float32`.

    Returns:
      (params, cfg) such that `moe(x, params, cfg)` computes what the block computes.

    Example:
      >>> block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
      >>> params, cfg = from_hf(block.state_dict(), config)
    """
    cfg = moe_config_from_hf(hf_config, **overrides)
    if prefix and not prefix.endswith("."):
        prefix += "."
    block = {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
    layout = _config_dict(hf_config)["model_type"]
    dtype = None if param_dtype is None else canonical_dtype(param_dtype)
    used: set[str] = set()

    def take(key: str, shape: tuple[int, ...], key_dtype: np.dtype | None = dtype) -> Array:
        used.add(key)
        return _take(block, key, shape, prefix=prefix, param_dtype=key_dtype)

    e, d, sf = cfg.num_experts, cfg.d_model, cfg.shared_width
    # The router and its bias stay f32 whatever `param_dtype` says, as in transformers:
    # selection is discontinuous, and rounding them can pick other experts.
    f32 = canonical_dtype("float32")
    router = take("gate.weight", (e, d), f32).T
    if layout == "deepseek_v3":
        bias = take("gate.e_score_correction_bias", (e,), f32)
    else:
        bias = jnp.zeros((e,), f32)
    w_gate, w_up, w_down = _expert_weights(take, block, cfg, layout)
    shared = {}
    if cfg.num_shared_experts:
        shared = dict(
            shared_w_gate=take("shared_experts.gate_proj.weight", (sf, d)).T,
            shared_w_up=take("shared_experts.up_proj.weight", (sf, d)).T,
            shared_w_down=take("shared_experts.down_proj.weight", (d, sf)).T,
        )
    unused = sorted(set(block) - used)
    if unused:
        raise ValueError(
            f"weights not understood (wrong prefix or layout?): {[prefix + k for k in unused[:8]]}"
        )
    params = MoEParams(
        router=router, router_bias=bias, w_gate=w_gate, w_up=w_up, w_down=w_down, **shared
    )
    validate_params(params, cfg)
    return params, cfg
