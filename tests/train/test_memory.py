"""The step's memory estimate: residual counting, the parts of the estimate, the choice of the
remat policy and the error that names the flags that fit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.train.cases import MICRO_MODEL, MICRO_TRAIN
from train import memory
from train.step import Trainer

ONE = dataclasses.replace(MICRO_TRAIN, devices=1, batch_size=8)


def test_residual_bytes_counts_what_the_backward_keeps():
    x = jax.ShapeDtypeStruct((1000,), jnp.float32)
    # d sin(x) needs cos(x): one f32 [1000] array beyond the input.
    assert memory.residual_bytes(lambda x: jnp.sin(x) * 2.0, x) == 4000
    # x * x keeps only x, which is an argument: nothing counted.
    assert memory.residual_bytes(lambda x: x * x, x) == 0
    # Two residuals of different dtypes.
    y = jax.ShapeDtypeStruct((10, 10), jnp.bfloat16)
    assert memory.residual_bytes(lambda y: jnp.sin(jnp.exp(y)), y) == 2 * 100 * 2


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    return Trainer(MICRO_MODEL, ONE, None)


def test_estimate_parts(trainer):
    estimates = {r: trainer.memory_estimate(r) for r in ("none", "attention", "block")}
    none, attention, block = estimates.values()
    assert block.activations_per_group < attention.activations_per_group
    assert attention.activations_per_group < none.activations_per_group
    # The block policy keeps each group's input: [B, S, D] in the model's dtype.
    assert block.activations_per_group == ONE.batch_size * ONE.seq_len * MICRO_MODEL.d_model * 4
    state = trainer.abstract_state
    held = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state))
    assert none.state == held
    params = sum(a.size for a in jax.tree.leaves(state.params))
    assert none.gradients == 4 * params
    assert none.total == none.state + none.gradients + none.activations + none.workspace


@pytest.mark.slow
def test_estimate_state_is_what_xla_takes_as_arguments(trainer):
    trainer.compile()
    analysis = trainer.compiled_memory()
    batch_bytes = 2 * ONE.batch_size * ONE.seq_len * 4
    assert analysis["argument"] - batch_bytes == trainer.memory_estimate().state


def test_gradient_accumulation_divides_the_activations():
    cfg = dataclasses.replace(ONE, grad_accum=2)
    half = Trainer(MICRO_MODEL, cfg, None).memory_estimate("none")
    whole = Trainer(MICRO_MODEL, ONE, None).memory_estimate("none")
    assert half.activations_per_group < whole.activations_per_group
    assert half.gradients == 2 * whole.gradients  # the running sum beside each microbatch's


def test_auto_picks_the_least_recomputation_that_fits(monkeypatch, trainer):
    totals = {r: trainer.memory_estimate(r).total for r in ("none", "attention", "block")}
    between = int((totals["attention"] + totals["none"]) / 2 / memory.FIT_FRACTION)
    monkeypatch.setattr(memory, "device_memory", lambda device: between)
    assert Trainer(MICRO_MODEL, ONE, None).remat == "attention"
    roomy = int(2 * totals["none"] / memory.FIT_FRACTION)
    monkeypatch.setattr(memory, "device_memory", lambda device: roomy)
    assert Trainer(MICRO_MODEL, ONE, None).remat == "none"


def test_too_big_names_the_flags_that_fit(monkeypatch, trainer):
    block = trainer.memory_estimate("block").total
    tight = int((block - 1) / memory.FIT_FRACTION)
    monkeypatch.setattr(memory, "device_memory", lambda device: tight)
    with pytest.raises(memory.DoesNotFit, match=r"will not fit: .* try --grad-accum \d+"):
        Trainer(MICRO_MODEL, ONE, None)
    explicit = dataclasses.replace(ONE, remat="none")
    roomy_for_block = int(block / memory.FIT_FRACTION) + 1
    monkeypatch.setattr(memory, "device_memory", lambda device: roomy_for_block)
    with pytest.raises(memory.DoesNotFit, match=r"try --remat (attention|block)"):
        Trainer(MICRO_MODEL, explicit, None)
    monkeypatch.setattr(memory, "device_memory", lambda device: 1000)
    with pytest.raises(memory.DoesNotFit, match="nothing at this model size fits"):
        Trainer(MICRO_MODEL, ONE, None)


def test_report_line():
    est = memory.MemoryEstimate(
        remat="none",
        grad_accum=1,
        state=2 * memory.GIB,
        gradients=memory.GIB,
        activations_per_group=memory.GIB // 2,
        groups=4,
        workspace=memory.GIB,
    )
    assert est.total == 6 * memory.GIB
    line = est.report(8 * memory.GIB)
    assert "= 6.00 GiB of the device's 8.0 GiB (75%)" in line
    assert est.fits(8 * memory.GIB) and not est.fits(6 * memory.GIB)
    assert np.isclose(est.activations, 2 * memory.GIB)
