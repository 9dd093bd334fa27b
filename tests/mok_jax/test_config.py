"""MoEConfig validation, presets and scale_down."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax import IMPLEMENTATIONS, MoEConfig, presets, scale_down

BASE = dict(d_model=64, d_ff=64, num_experts=8, top_k=2)


def test_defaults():
    cfg = MoEConfig(**BASE)
    assert cfg.score_fn == "softmax" and cfg.norm_topk_prob is False
    assert cfg.routed_scaling == 1.0 and cfg.num_groups is None and cfg.topk_groups is None
    assert cfg.num_shared_experts == 0 and cfg.capacity_factor is None
    assert cfg.dtype == jnp.bfloat16 and cfg.implementation == "xla"
    assert set(IMPLEMENTATIONS) == {"reference", "xla", "pallas", "fused"}


def test_frozen_keyword_only_hashable():
    cfg = MoEConfig(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.top_k = 3
    with pytest.raises(TypeError):
        MoEConfig(64, 64, 8, 2)
    assert hash(cfg) == hash(MoEConfig(**BASE)) and cfg == MoEConfig(**BASE)
    jax.jit(lambda x, c: x * c.top_k, static_argnums=1)(jnp.ones(2), cfg)


@pytest.mark.parametrize(
    "dtype", [jnp.bfloat16, np.float32, "bfloat16", "bf16", "float32", jnp.dtype("float16"), "fp16"]
)
def test_dtype_forms(dtype):
    cfg = MoEConfig(**BASE, dtype=dtype)
    assert isinstance(cfg.dtype, np.dtype)
    assert cfg == MoEConfig(**BASE, dtype=cfg.dtype.name)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(top_k=9), r"top_k=9 must be <= num_experts=8"),
        (dict(top_k=0), r"top_k=0 must be >= 1"),
        (dict(d_model=64.0), r"d_model=64.0 must be an int"),
        (dict(num_experts=True), r"num_experts=True must be an int"),
        (dict(score_fn="relu"), r"score_fn='relu' must be one of \('softmax', 'sigmoid'\)"),
        (dict(implementation="cuda"), r"implementation='cuda' must be one of"),
        (dict(num_groups=3, topk_groups=1), r"num_groups=3 must divide num_experts=8"),
        (dict(num_groups=8, topk_groups=1), r"each group needs >= 2 experts"),
        (dict(num_groups=4, topk_groups=5), r"topk_groups=5 must be <= num_groups=4"),
        (dict(num_groups=4), r"must be set together"),
        (dict(num_groups=4, topk_groups=1, top_k=3), r"top_k=3 must be <= the 2 experts"),
        (dict(dtype="int32"), r"must be a floating dtype"),
        (dict(dtype="float99"), r"is not a dtype"),
        (dict(capacity_factor=0.0), r"capacity_factor=0.0 must be finite and > 0"),
        (dict(aux_loss_coef=-1.0), r"aux_loss_coef=-1.0 must be finite and >= 0"),
        (dict(routed_scaling=float("nan")), r"routed_scaling=nan must be finite"),
        (dict(norm_topk_prob=1), r"norm_topk_prob=1 must be a bool"),
        (dict(exchange_on_one_device="yes"), r"exchange_on_one_device='yes' must be a bool"),
        (dict(exchange_fusion="all"), r"exchange_fusion='all' must be one of"),
        (dict(num_shared_experts=-1), r"num_shared_experts=-1 must be >= 0"),
        (dict(token_chunk=4), r"token_chunk=4 must be >= 8"),
        (dict(token_chunk=12), r"token_chunk=12 must be a multiple of 8"),
        (dict(exchange_tile=0), r"exchange_tile=0 must be >= 1"),
        (dict(fused_rows="both"), r"fused_rows='both' must be one of"),
        (dict(fused_residuals="h"), r"fused_residuals='h' must be one of"),
        (dict(fused_recompute="xla"), r"fused_recompute='xla' must be one of"),
    ],
)
def test_bad_values_name_themselves(changes, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{**BASE, **changes})


def test_replace_revalidates():
    with pytest.raises(ValueError, match="top_k=9"):
        dataclasses.replace(MoEConfig(**BASE), top_k=9)


@pytest.mark.parametrize(
    "factor, tokens, expected",
    [(1.0, 64, 16), (1.25, 64, 20), (1.1, 40, 11), (0.5, 3, 1), (2.0, 1, 1)],
)
def test_capacity_is_exact(factor, tokens, expected):
    # 1.1 * 40 * 2 / 8 is 11 on paper and 11.000000000000002 in floats.
    assert MoEConfig(**BASE, capacity_factor=factor).capacity(tokens) == expected
    assert MoEConfig(**BASE).capacity(tokens) is None


def test_presets():
    assert set(presets) == {
        "tiny",
        "switch",
        "mixtral_8x7b",
        "deepseek_v3",
        "qwen3_30b_a3b",
        "mok_bench",
    }
    ds = presets["deepseek_v3"]
    assert (ds.num_experts, ds.top_k, ds.num_shared_experts, ds.score_fn) == (256, 8, 1, "sigmoid")
    assert (ds.num_groups, ds.topk_groups, ds.routed_scaling, ds.norm_topk_prob) == (
        8,
        4,
        2.5,
        True,
    )
    assert presets["switch"].top_k == 1 and presets["switch"].capacity_factor == 1.25
    mok = presets["mok_bench"]
    assert (mok.d_model, mok.d_ff, mok.num_experts, mok.top_k) == (7168, 3072, 384, 6)
    with pytest.raises(TypeError):
        presets["mine"] = ds


@pytest.mark.parametrize("name", sorted(presets))
def test_scale_down_keeps_routing(name):
    cfg = presets[name]
    small = scale_down(cfg)
    assert small.d_model == 64 and small.d_ff == 64 and small.num_experts <= 32
    for field in (
        "score_fn",
        "norm_topk_prob",
        "routed_scaling",
        "num_groups",
        "topk_groups",
        "num_shared_experts",
        "aux_loss_coef",
        "z_loss_coef",
        "capacity_factor",
        "dtype",
        "implementation",
    ):
        assert getattr(small, field) == getattr(cfg, field), field
    assert small.top_k == min(cfg.top_k, small.num_experts)


def test_scale_down_rounds_experts_to_groups():
    cfg = MoEConfig(d_model=128, d_ff=128, num_experts=96, top_k=6, num_groups=12, topk_groups=3)
    small = scale_down(cfg, max_experts=30)
    assert small.num_experts == 24 and small.top_k == 6
    tiny = scale_down(cfg, max_experts=4)  # two experts per group at least
    assert tiny.num_experts == 24
    assert scale_down(presets["deepseek_v3"], max_experts=16).top_k == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=96), "d_model=96 must be a multiple of 64"),
        (dict(d_ff=32), "d_ff=32 must be >= 64"),
        (dict(max_experts=0), "max_experts=0 must be >= 1"),
    ],
)
def test_scale_down_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        scale_down(presets["tiny"], **kwargs)
