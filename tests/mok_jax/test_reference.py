"""The oracle against the semantics written out once more, token by token, in float64 numpy.

Each cast to the compute dtype happens where the semantics put it (inputs and weights of every
GEMM, the SwiGLU output h); everything else is float64. If the reference and this loop agree,
the reference is what the issue specifies, not merely what the other implementations do.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mok_jax import MoEConfig, moe
from tests.mok_jax.cases import SCALED_PRESETS, assert_close, random_inputs, with_impl


def _ranked(values: np.ndarray) -> list[int]:
    return sorted(range(len(values)), key=lambda i: (-values[i], i))


def numpy_moe(x: np.ndarray, p: dict[str, np.ndarray], cfg: MoEConfig):
    """(y [T, D] float64, tokens_per_expert, dropped, aux_loss, z_loss), one token at a time."""

    def rounded(a):
        return np.asarray(a).astype(cfg.dtype).astype(np.float64)

    def swiglu(v, w_gate, w_up, w_down):
        gate, up = rounded(v) @ rounded(w_gate), rounded(v) @ rounded(w_up)
        return rounded(gate / (1 + np.exp(-gate)) * up) @ rounded(w_down)

    x = np.asarray(x, np.float64)
    num_tokens, e_count = x.shape[0], cfg.num_experts
    logits = x @ p["router"]
    if cfg.score_fn == "softmax":
        scores = np.exp(logits - logits.max(1, keepdims=True))
        scores /= scores.sum(1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    capacity = cfg.capacity(num_tokens)
    load = np.zeros(e_count, int)
    y = np.zeros_like(x)
    dropped = 0
    for t in range(num_tokens):
        biased = scores[t] + p["router_bias"]
        candidates = _ranked(biased)
        if cfg.num_groups:
            size = e_count // cfg.num_groups
            group_scores = [
                sum(sorted(biased[g * size : (g + 1) * size])[-2:]) for g in range(cfg.num_groups)
            ]
            kept = _ranked(np.array(group_scores))[: cfg.topk_groups]
            candidates = [e for e in candidates if e // size in kept]
        chosen = candidates[: cfg.top_k]
        weights = scores[t, chosen]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum()
        weights = weights * cfg.routed_scaling
        for e, w in zip(chosen, weights, strict=True):
            load[e] += 1
            if capacity is not None and load[e] > capacity:
                dropped += 1
                continue
            y[t] += w * swiglu(x[t], p["w_gate"][e], p["w_up"][e], p["w_down"][e])
        if cfg.num_shared_experts:
            y[t] += swiglu(x[t], p["shared_w_gate"], p["shared_w_up"], p["shared_w_down"])
    probs = (scores / scores.sum(1, keepdims=True)).mean(0)
    aux_loss = cfg.aux_loss_coef * e_count * np.sum(load / (num_tokens * cfg.top_k) * probs)
    lse = np.log(np.exp(logits).sum(1))
    return y, load, dropped, aux_loss, cfg.z_loss_coef * np.mean(lse**2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", sorted(SCALED_PRESETS))
def test_reference_follows_the_semantics(preset, dtype):
    cfg = with_impl(SCALED_PRESETS[preset], "reference", dtype=dtype)
    x, params, _ = random_inputs(cfg, 24, seed=7, x_dtype="float32")
    if preset == "switch":  # make the capacity bite: crowd expert 0
        params = dataclasses.replace(params, router_bias=params.router_bias.at[0].set(0.1))
    y, aux = moe(x, params, cfg)
    as_numpy = {
        k: None if v is None else np.asarray(v, np.float64) for k, v in vars(params).items()
    }
    y_np, load, dropped, aux_loss, z_loss = numpy_moe(np.asarray(x), as_numpy, cfg)
    np.testing.assert_array_equal(aux.tokens_per_expert, load)
    assert int(aux.dropped) == dropped
    if preset == "switch":
        assert dropped > 0
    # y is rounded to x's dtype (f32) once; the loop stays in f64 throughout.
    assert_close(y, y_np.astype(np.float32), cfg.dtype)
    assert_close((aux.aux_loss, aux.z_loss), (np.float32(aux_loss), np.float32(z_loss)), "float32")
