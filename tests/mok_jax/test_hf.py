"""Weight import from Hugging Face MoE blocks: each layout built from known params by the inverse
mapping (numpy only, always run), and transformers' own blocks against `moe` (skipped without
torch and transformers)."""

from __future__ import annotations

import dataclasses
import functools
import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax import MoEConfig, MoEParams, init_params, moe
from mok_jax.hf import from_hf
from tests.mok_jax.cases import assert_close

D, F = 16, 8  # D != F: a transposed weight cannot pass for the right one
LAYOUTS = ("mixtral", "qwen3_moe", "deepseek_v3")
HF_CONFIGS = {
    "mixtral": dict(
        model_type="mixtral",
        hidden_size=D,
        intermediate_size=F,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=D,
        moe_intermediate_size=F,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        hidden_size=D,
        moe_intermediate_size=F,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        n_shared_experts=2,
        norm_topk_prob=True,
        hidden_act="silu",
    ),
}
EXPECTED_CONFIGS = {
    "mixtral": MoEConfig(
        d_model=D, d_ff=F, num_experts=4, top_k=2, norm_topk_prob=True, aux_loss_coef=0.02
    ),
    "qwen3_moe": MoEConfig(d_model=D, d_ff=F, num_experts=4, top_k=2),
    "deepseek_v3": MoEConfig(
        d_model=D,
        d_ff=F,
        num_experts=8,
        top_k=3,
        score_fn="sigmoid",
        norm_topk_prob=True,
        routed_scaling=2.5,
        num_groups=4,
        topk_groups=2,
        num_shared_experts=2,
    ),
}


@functools.cache
def known_params(layout: str) -> MoEParams:
    """Random params; DeepSeek-V3 gets a random router bias, the others the zeros they import."""
    key_params, key_bias = jax.random.split(jax.random.key(LAYOUTS.index(layout)))
    params = init_params(key_params, EXPECTED_CONFIGS[layout])
    if layout == "deepseek_v3":
        params = dataclasses.replace(params, router_bias=jax.random.normal(key_bias, (8,)))
    return params


def fused_weights(layout: str) -> dict[str, np.ndarray]:
    """The block's state dict as transformers >= 5 holds it: the inverse of `from_hf`."""
    p = jax.tree.map(np.asarray, known_params(layout))
    weights = {
        "gate.weight": p.router.T,
        "experts.gate_up_proj": np.concatenate([p.w_gate, p.w_up], axis=2).swapaxes(1, 2),
        "experts.down_proj": p.w_down.swapaxes(1, 2),
    }
    if layout == "deepseek_v3":
        weights["gate.e_score_correction_bias"] = p.router_bias
        for name in ("gate", "up", "down"):
            weights[f"shared_experts.{name}_proj.weight"] = getattr(p, f"shared_w_{name}").T
    return weights


def per_expert_weights(layout: str) -> dict[str, np.ndarray]:
    """The same weights as Hub checkpoints store them, one [F, D] / [D, F] matrix per expert."""
    weights = fused_weights(layout)
    gate_edf, up_edf = np.split(weights.pop("experts.gate_up_proj"), 2, axis=1)
    down_edf = weights.pop("experts.down_proj")
    names = ("w1", "w3", "w2") if layout == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for name, stacked in zip(names, (gate_edf, up_edf, down_edf), strict=True):
        weights |= {f"experts.{e}.{name}.weight": w for e, w in enumerate(stacked)}
    return weights


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_layout_gives_the_params_back(layout):
    params, cfg = from_hf(fused_weights(layout), HF_CONFIGS[layout])
    chex.assert_trees_all_equal(params, known_params(layout))
    assert cfg == EXPECTED_CONFIGS[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_expert_layout_matches_fused(layout):
    params, cfg = from_hf(per_expert_weights(layout), HF_CONFIGS[layout])
    chex.assert_trees_all_equal(params, known_params(layout))
    assert cfg == EXPECTED_CONFIGS[layout]


def test_qwen3_config_as_transformers_5_writes_it():
    """transformers 5 stores Qwen3-MoE's expert count as `num_local_experts` (`num_experts` is
    an alias), so a `Qwen3MoeConfig.to_dict()` has only that key."""
    hf_config = {**HF_CONFIGS["qwen3_moe"], "num_local_experts": 4}
    del hf_config["num_experts"]
    assert from_hf(fused_weights("qwen3_moe"), hf_config)[1] == EXPECTED_CONFIGS["qwen3_moe"]


def test_prefix_picks_one_block_of_a_model():
    layers = {
        f"model.layers.{l}.mlp.{k}": v * scale  # layer 11's keys start with layer 1's
        for l, scale in ((1, 1), (11, 2))
        for k, v in fused_weights("mixtral").items()
    }
    model = {"model.embed_tokens.weight": np.ones((32, D), np.float32), **layers}
    for prefix in ("model.layers.1.mlp", "model.layers.1.mlp."):
        params, _ = from_hf(model, HF_CONFIGS["mixtral"], prefix=prefix)
        chex.assert_trees_all_equal(params, known_params("mixtral"))


def test_param_dtype_and_overrides():
    params, cfg = from_hf(
        fused_weights("deepseek_v3"),
        HF_CONFIGS["deepseek_v3"],
        param_dtype="bf16",
        dtype="float32",
        implementation="reference",
    )
    known = known_params("deepseek_v3")
    expected = jax.tree.map(lambda a: a.astype(jnp.bfloat16), known)
    # The router and its bias stay f32: rounding them could change which experts are chosen.
    expected = dataclasses.replace(expected, router=known.router, router_bias=known.router_bias)
    chex.assert_trees_all_equal(params, expected)
    assert (cfg.dtype, cfg.implementation) == (jnp.float32, "reference")


def spoil(layout: str, *, per_expert=False, drop=(), add=None, **config_changes):
    """(weights, hf_config) of `layout` with keys dropped or added and config fields changed."""
    weights = per_expert_weights(layout) if per_expert else fused_weights(layout)
    weights = {k: v for k, v in weights.items() if k not in drop} | (add or {})
    return weights, {**HF_CONFIGS[layout], **config_changes}


def zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.float32)


BAD_INPUTS = {  # name: (layout, what `spoil` changes, the error's message)
    "unknown model_type": ("mixtral", dict(model_type="llama"), "model_type='llama'"),
    "not silu": ("qwen3_moe", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    "config field missing": ("mixtral", dict(num_local_experts=None), "num_local_experts"),
    "deepseek groups missing": ("deepseek_v3", dict(n_group=None, topk_group=None), "n_group"),
    "router missing": ("qwen3_moe", dict(drop=["gate.weight"]), "'gate.weight'"),
    "down_proj missing": ("qwen3_moe", dict(drop=["experts.down_proj"]), "'experts.down_proj'"),
    "one expert missing": (
        "mixtral",
        dict(per_expert=True, drop=["experts.3.w3.weight"]),
        "'experts.3.w3.weight'",
    ),
    "bias missing": (
        "deepseek_v3",
        dict(drop=["gate.e_score_correction_bias"]),
        "'gate.e_score_correction_bias'",
    ),
    "shared expert missing": (
        "deepseek_v3",
        dict(drop=["shared_experts.up_proj.weight"]),
        "'shared_experts.up_proj.weight'",
    ),
    "unknown key": ("mixtral", dict(add={"lm_head.weight": zeros(F, D)}), "lm_head.weight"),
    "expert out of range": (
        "mixtral",
        dict(per_expert=True, add={"experts.4.w1.weight": zeros(F, D)}),
        "experts.4.w1.weight",
    ),
    "mixtral names as qwen3": (
        "mixtral",
        dict(per_expert=True, model_type="qwen3_moe", num_experts=4, moe_intermediate_size=F),
        "'experts.0.gate_proj.weight'",
    ),
    "shared experts not configured": (
        "deepseek_v3",
        dict(n_shared_experts=0),
        "not understood.*shared_experts.down_proj.weight",
    ),
    "router shape": (
        "mixtral",
        dict(add={"gate.weight": zeros(D, 4)}),
        r"'gate.weight' has shape \(16, 4\), expected \(4, 16\)",
    ),
    "gate_up shape": (
        "qwen3_moe",
        dict(add={"experts.gate_up_proj": zeros(4, F, D)}),
        r"'experts.gate_up_proj' has shape \(4, 8, 16\), expected \(4, 16, 16\)",
    ),
    "down_proj transposed": (
        "qwen3_moe",
        dict(add={"experts.down_proj": zeros(4, F, D)}),
        r"'experts.down_proj' has shape \(4, 8, 16\), expected \(4, 16, 8\)",
    ),
    "per-expert shape": (
        "mixtral",
        dict(per_expert=True, add={"experts.2.w2.weight": zeros(F, D)}),
        r"'experts.2.w2.weight' has shape \(8, 16\), expected \(16, 8\)",
    ),
}


@pytest.mark.parametrize("layout, changes, message", BAD_INPUTS.values(), ids=BAD_INPUTS)
def test_bad_input_is_a_clear_error(layout, changes, message):
    with pytest.raises(ValueError, match=message):
        from_hf(*spoil(layout, **changes))


# --- Against transformers' own blocks (float32, CPU). -------------------------------------------

TRANSFORMERS_BLOCKS = {  # case: (module, block class, config class, config fields)
    "mixtral": (
        "mixtral.modeling_mixtral",
        "MixtralSparseMoeBlock",
        "MixtralConfig",
        dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2),
    ),
    "qwen3_moe_normalized": (
        "qwen3_moe.modeling_qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        "Qwen3MoeConfig",
        dict(moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
    ),
    "qwen3_moe_raw": (
        "qwen3_moe.modeling_qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        "Qwen3MoeConfig",
        dict(moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False),
    ),
    "deepseek_v3": (
        "deepseek_v3.modeling_deepseek_v3",
        "DeepseekV3MoE",
        "DeepseekV3Config",
        dict(
            moe_intermediate_size=64,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
        ),
    ),
}


def transformers_block(case: str):
    """(block, config, torch) with every parameter and buffer a seeded N(0, 0.15^2): the
    blocks create their experts with torch.empty, and a spread keeps routing non-degenerate."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    module, block_class, config_class, fields = TRANSFORMERS_BLOCKS[case]
    config = getattr(transformers, config_class)(hidden_size=64, **fields)
    block = getattr(importlib.import_module(f"transformers.models.{module}"), block_class)(config)
    generator = torch.Generator().manual_seed(len(case))
    with torch.no_grad():
        for tensor in [*block.parameters(), *block.buffers()]:
            tensor.copy_(0.15 * torch.randn(tensor.shape, generator=generator))
    return block.eval(), config, torch


@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("case", sorted(TRANSFORMERS_BLOCKS))
def test_matches_transformers(case, implementation):
    block, config, torch = transformers_block(case)
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = block(x).numpy()
    params, cfg = from_hf(
        block.state_dict(), config, dtype="float32", implementation=implementation
    )
    y, _ = moe(jnp.asarray(x.numpy()), params, cfg)
    chex.assert_type(y, jnp.float32)
    assert_close(y, expected, jnp.float32)


def test_bfloat16_torch_tensors_keep_their_dtype():
    block, config, torch = transformers_block("deepseek_v3")
    params_f32, _ = from_hf(block.state_dict(), config)
    params, _ = from_hf({k: v.to(torch.bfloat16) for k, v in block.state_dict().items()}, config)
    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params_f32)
    expected = dataclasses.replace(
        rounded,
        router=rounded.router.astype(jnp.float32),
        router_bias=rounded.router_bias.astype(jnp.float32),
    )
    chex.assert_trees_all_equal(params, expected)
