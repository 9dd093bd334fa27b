"""MoEConfig validation, presets and scale_down."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax import IMPLEMENTATIONS, MoEConfig, MoEOptions, presets, scale_down
from mok_jax.config import MOVED_FIELDS

BASE = dict(d_model=64, d_ff=64, num_experts=8, top_k=2)


def test_defaults():
    cfg = MoEConfig(**BASE)
    assert cfg.score_fn == "softmax" and cfg.norm_topk_prob is False
    assert cfg.routed_scaling == 1.0 and cfg.num_groups is None and cfg.topk_groups is None
    assert cfg.num_shared_experts == 0 and cfg.capacity_factor is None
    assert cfg.dtype == jnp.bfloat16 and cfg.implementation == "auto"
    assert cfg.options == MoEOptions() and cfg.options.explicit() == ()
    assert set(IMPLEMENTATIONS) == {"reference", "xla", "pallas", "fused"}


def test_at_most_twenty_fields():
    # The model's function and the few parallelism fields; the performance knobs are options.
    assert len(dataclasses.fields(MoEConfig)) <= 20


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
        (dict(implementation="cuda"), r"implementation='cuda' must be 'auto' or one of"),
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
        (dict(num_shared_experts=-1), r"num_shared_experts=-1 must be >= 0"),
        (dict(options={"rows": "copied"}), r"must be a MoEOptions"),
        (dict(implementation="fused", dtype="float32"), r"'fused' computes in bfloat16"),
        (dict(implementation="pallas", d_ff=96), r"'pallas' needs d_ff=96 to be a multiple"),
        (dict(implementation="fused", exchange="ring"), r"exchange='ring' is for 'xla'"),
        (
            dict(implementation="xla", options=MoEOptions(residuals="inputs")),
            r"options residuals are the 'fused' implementation's, not implementation='xla'",
        ),
        (
            dict(implementation="pallas", options=MoEOptions(exchange_on_one_device=True)),
            r"options exchange_on_one_device are the 'fused'",
        ),
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


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(token_chunk=4), r"token_chunk=4 must be 'auto' or an int >= 8"),
        (dict(token_chunk=12), r"token_chunk=12 must be a multiple of 8"),
        (dict(token_chunk="big"), r"token_chunk='big' must be 'auto' or an int"),
        (dict(exchange_tile=0), r"exchange_tile=0 must be 'auto' or an int >= 1"),
        (dict(exchange_programs=-1), r"exchange_programs=-1 must be"),
        (dict(exchange_programs=True), r"exchange_programs=True must be"),
        (dict(rows="both"), r"rows='both' must be 'auto' or one of"),
        (dict(residuals="h"), r"residuals='h' must be 'auto' or one of"),
        (dict(recompute="xla"), r"recompute='xla' must be 'auto' or one of"),
        (dict(exchange_fusion="all"), r"exchange_fusion='all' must be 'auto' or one of"),
        (dict(exchange_on_one_device="yes"), r"exchange_on_one_device='yes' must be a bool"),
        (dict(exchange_fusion="forward", exchange_programs=0), r"needs exchange_programs > 0"),
    ],
)
def test_bad_options_name_themselves(changes, message):
    with pytest.raises(ValueError, match=message):
        MoEOptions(**changes)


def test_with_options_and_token_chunk_everywhere():
    cfg = MoEConfig(**BASE).with_options(residuals="gate_up", token_chunk=64)
    assert cfg.options == MoEOptions(residuals="gate_up", token_chunk=64)
    for impl in ("reference", "xla", "pallas"):  # the token-wise stages' chunk is anyone's
        MoEConfig(**BASE, implementation=impl, options=MoEOptions(token_chunk=64))


def test_options_explicit_names_what_was_set():
    options = MoEOptions(token_chunk=2048, residuals="gate_up")
    assert options.explicit() == ("token_chunk", "residuals")
    assert not options.is_resolved()
    assert hash(options) == hash(MoEOptions(token_chunk=2048, residuals="gate_up"))


def test_to_dict_from_dict_round_trip():
    cfg = MoEConfig(**BASE, implementation="fused", options=MoEOptions(residuals="gate_up"))
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg
    assert MoEConfig.from_dict(presets["deepseek_v3"].to_dict()) == presets["deepseek_v3"]


def _saved_before_options(**fields) -> dict:
    """A config dict as saved before the options moved: the flat fields at their defaults."""
    data = {k: v for k, v in MoEConfig(**BASE).to_dict().items() if k != "options"}
    old = dict(
        exchange_tile=64,
        exchange_programs=24,
        exchange_fusion="per_gemm",
        exchange_on_one_device=False,
        fused_rows="copied",
        fused_residuals="inputs",
        fused_recompute="gmm",
        token_chunk=None,
    )
    return {**data, "implementation": "xla", **old, **fields}


def test_from_dict_reads_the_flat_fields_with_a_warning_naming_new_places():
    with pytest.warns(DeprecationWarning) as record:
        cfg = MoEConfig.from_dict(_saved_before_options())
    message = str(record[0].message)
    for old, new in MOVED_FIELDS.items():
        assert f"{old} -> options.{new}" in message
    # Saved defaults read as "auto" (which resolves to them); token_chunk None as its number,
    # 8 row tiles, so the token-wise stages keep their bits.
    assert cfg.options == MoEOptions(token_chunk=8 * cfg.row_tile)
    assert cfg.implementation == "xla"


def test_from_dict_keeps_saved_choices():
    saved = _saved_before_options(
        implementation="fused", fused_residuals="gate_up", token_chunk=2048, exchange_tile=16
    )
    with pytest.warns(DeprecationWarning):
        cfg = MoEConfig.from_dict(saved)
    assert cfg.options == MoEOptions(residuals="gate_up", token_chunk=2048, exchange_tile=16)


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match=r"no fields \['colour'\]"):
        MoEConfig.from_dict({**MoEConfig(**BASE).to_dict(), "colour": "blue"})
