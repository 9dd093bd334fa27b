"""The language model: shapes, causality, reference vs xla, FLOP count, configs."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mok_jax import MoEConfig
from mok_jax.tolerances import relative_error, tolerance
from tests.train.cases import MICRO_MODEL
from train.config import PRESETS, ModelConfig, TrainConfig
from train.model import (
    LanguageModel,
    count_params,
    cross_entropy,
    model_flops_per_token,
    peak_flops,
    rotary,
)


def _tokens(shape, seed=0):
    return jax.random.randint(jax.random.key(seed), shape, 0, 256, jnp.int32)


def _with_implementation(cfg: ModelConfig, implementation: str) -> ModelConfig:
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, implementation=implementation))


@pytest.fixture(scope="module")
def model() -> LanguageModel:
    return LanguageModel(MICRO_MODEL, rngs=nnx.Rngs(0))


@nnx.jit
def _forward(model: LanguageModel, tokens):
    return model(tokens)


def test_shapes_and_blocks(model):
    logits, aux = _forward(model, _tokens((2, 16)))
    chex.assert_shape(logits, (2, 16, 256))
    assert logits.dtype == jnp.float32
    # moe_every=2: one group of a dense block, then an MoE block, stacked over G = 1.
    assert len(model.groups.dense) == 1 and not model.groups.dense[0].is_moe
    assert model.groups.moe.is_moe and len(model.tail) == 0
    chex.assert_shape(aux.tokens_per_expert, (1, MICRO_MODEL.moe.num_experts))
    assert int(aux.tokens_per_expert.sum()) == 2 * 16 * MICRO_MODEL.moe.top_k


@pytest.mark.slow
def test_every_block_moe():
    cfg = dataclasses.replace(MICRO_MODEL, moe_every=1)
    _, aux = _forward(LanguageModel(cfg, rngs=nnx.Rngs(0)), _tokens((1, 8)))
    assert aux.tokens_per_expert.shape[0] == cfg.n_layers == cfg.num_moe_layers


@pytest.mark.slow
def test_stacked_groups_and_a_dense_tail():
    """5 blocks with an MoE every 2nd: 2 groups (dense, MoE) stacked on a leading axis of 2,
    then one dense block; each stacked group holds its own weights."""
    cfg = dataclasses.replace(MICRO_MODEL, n_layers=5)
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    w_gate = model.groups.moe.ffn.w_gate[...]
    chex.assert_shape(w_gate, (2, 8, 32, 32))
    assert not np.array_equal(w_gate[0], w_gate[1])
    assert len(model.tail) == 1 and not model.tail[0].is_moe
    _, aux = _forward(model, _tokens((1, 8)))
    chex.assert_shape(aux.rounds, (2,))


@pytest.mark.slow
def test_scan_equals_the_blocks_one_by_one():
    """The scan over the stacked groups computes what applying each group in turn computes,
    bit for bit on the forward, and every remat policy gives the same loss and gradients."""
    cfg = dataclasses.replace(MICRO_MODEL, n_layers=4)
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    tokens = _tokens((2, 16), seed=1)
    graphdef, state = nnx.split(model.groups)

    def by_hand(model, tokens):
        x = jax.nn.one_hot(tokens, 256, dtype=cfg.dtype) @ model.embed[...].astype(cfg.dtype)
        for g in range(cfg.num_moe_layers):
            group = nnx.merge(graphdef, jax.tree.map(lambda a, g=g: a[g], state))
            x, _ = group(x)
        x = model.final_norm(x)
        return jnp.dot(x.astype(jnp.float32), model.head[...])

    scanned, _ = _forward(model, tokens)
    np.testing.assert_array_equal(scanned, jax.jit(by_hand)(model, tokens))

    def loss(model, remat):
        logits, aux = model(tokens[:, :-1], remat)
        return cross_entropy(logits, tokens[:, 1:]) + jnp.sum(aux.loss)

    results = {
        remat: nnx.jit(nnx.value_and_grad(loss), static_argnums=1)(model, remat)
        for remat in ("none", "attention", "block")
    }
    for remat in ("attention", "block"):
        chex.assert_trees_all_close(results[remat], results["none"], rtol=1e-6, atol=1e-7)


def test_causal(model):
    """Changing the byte at position p changes no logit before p."""
    tokens = _tokens((2, 16))
    changed = tokens.at[:, 9].set((tokens[:, 9] + 1) % 256)
    before, _ = _forward(model, tokens)
    after, _ = _forward(model, changed)
    np.testing.assert_array_equal(before[:, :9], after[:, :9])
    assert not np.array_equal(before[:, 9:], after[:, 9:])


def test_rotary_is_relative():
    """q(p) . k(p') depends on p - p' only: shifting both positions keeps the scores."""
    q = jax.random.normal(jax.random.key(0), (1, 8, 1, 16))
    k = jax.random.normal(jax.random.key(1), (1, 8, 1, 16))
    # The same vectors at positions 0..7 and (by prepending 3 rows) at positions 3..10.
    pad = jnp.zeros((1, 3, 1, 16))
    rq, rk = rotary(q, 100.0), rotary(k, 100.0)
    sq, sk = (
        rotary(jnp.concatenate([pad, q], 1), 100.0),
        rotary(jnp.concatenate([pad, k], 1), 100.0),
    )
    scores = jnp.einsum("bsnh,btnh->st", rq, rk)
    shifted = jnp.einsum("bsnh,btnh->st", sq[:, 3:], sk[:, 3:])
    chex.assert_trees_all_close(scores, shifted, rtol=1e-5, atol=1e-5)


def _loss_and_grad_norm(cfg: ModelConfig, tokens):
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))

    def loss(model):
        logits, aux = model(tokens[:, :-1])
        return cross_entropy(logits, tokens[:, 1:]) + jnp.sum(aux.loss)

    return nnx.jit(nnx.value_and_grad(loss))(model)


@pytest.mark.slow
def test_reference_and_xla_agree():
    """One device, no mesh: the two MoE implementations give the same loss and gradients
    within the f32 tolerance of mok_jax.tolerances."""
    tokens = _tokens((4, 17), seed=3)
    loss_ref, grads_ref = _loss_and_grad_norm(
        _with_implementation(MICRO_MODEL, "reference"), tokens
    )
    loss_xla, grads_xla = _loss_and_grad_norm(_with_implementation(MICRO_MODEL, "xla"), tokens)
    tol = tolerance(jnp.float32)
    assert relative_error(loss_xla, loss_ref) <= tol.rtol, (float(loss_xla), float(loss_ref))
    for (path, g_xla), g_ref in zip(
        jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads_xla)),
        jax.tree.leaves(nnx.to_pure_dict(grads_ref)),
        strict=True,
    ):
        err = relative_error(g_xla, g_ref)
        assert err <= tol.atol, f"{jax.tree_util.keystr(path)}: {err=}"


def test_flops_per_token_by_hand():
    cfg = MICRO_MODEL
    d, nh, s, v = 32, 32, 32, 256
    attention = 2 * d * 3 * nh + 2 * nh * d + 4 * s * nh
    moe = 2 * d * 8 + 2 * 3 * 2 * d * 32  # router + top-2 experts of width 32
    dense = 3 * 2 * d * (2 * 32)  # dense width = top_k * d_ff
    expected = 3 * (2 * attention + moe + dense + 2 * d * v)
    assert model_flops_per_token(cfg, s) == expected


def test_count_params_active(model):
    total, active = count_params(model)
    assert total - active == (8 - 2) * 3 * 32 * 32  # one MoE block, 6 idle experts


def test_peak_flops_unknown_on_cpu():
    assert peak_flops(jax.devices()[0]) is None


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(head_dim=15), "head_dim=15 must be even"),
        (dict(d_model=48), "moe.d_model=32 must equal d_model=48"),
        (dict(moe_every=3), "moe_every=3 > n_layers=2"),
        (dict(n_layers=0), "n_layers=0 must be >= 1"),
        (dict(dtype="int8"), "floating"),
        (dict(moe="tiny"), "must be a mok_jax.MoEConfig"),
    ],
)
def test_model_config_validates(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(MICRO_MODEL, **changes)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(warmup_steps=20), "warmup_steps=20 must be < schedule_steps=20"),
        (dict(batch_size=0), "batch_size=0 must be >= 1"),
        (dict(eval_fraction=0.0), "must be > 0"),
        (dict(implementation="bogus"), "implementation='bogus'"),
        (dict(data_parallel=2), "needs layout='data_expert'"),
        (dict(peak_lr=float("nan")), "peak_lr=nan must be finite"),
    ],
)
def test_train_config_validates(changes, match):
    base = TrainConfig(
        steps=5, schedule_steps=20, warmup_steps=2, peak_lr=1e-3, batch_size=8, seq_len=16
    )
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(base, **changes)


def test_config_json_round_trip():
    for preset in PRESETS.values():
        assert ModelConfig.from_json(preset.model.to_json()) == preset.model


def test_presets_fit_their_meshes():
    tiny = PRESETS["tiny"]
    assert tiny.model.moe.num_experts % 8 == 0 and tiny.train.batch_size % 8 == 0
    assert isinstance(PRESETS["gpu"].model.moe, MoEConfig)


@pytest.mark.parametrize("name", ["small", "gpu"], ids=lambda name: f"preset_{name}")
def test_larger_presets_trace(name):
    """The larger presets build and run forward abstractly (shapes and dtypes, no compute)."""
    cfg = PRESETS[name].model
    model = nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))
    logits, aux = nnx.eval_shape(lambda m, t: m(t), model, jax.ShapeDtypeStruct((2, 64), jnp.int32))
    assert logits.shape == (2, 64, 256) and logits.dtype == jnp.float32
    assert aux.tokens_per_expert.shape == (cfg.num_moe_layers, cfg.moe.num_experts)
