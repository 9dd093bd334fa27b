"""The step cache: a lowered step kept and read back gives the same bits; its key moves with
what the step depends on; a damaged file or a step jax.export refuses falls back to tracing."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax import export

from tests.train.cases import MICRO_MODEL, MICRO_TRAIN
from train import compile_cache, data
from train.step import Trainer

ONE = dataclasses.replace(MICRO_TRAIN, devices=1, batch_size=4)
SYNTHETIC = data.load_bytes("synthetic")


@pytest.fixture
def cache(tmp_path):
    root = compile_cache.enable(tmp_path)
    yield root
    compile_cache.enable(None)


def _one_step(trainer: Trainer):
    x, y = data.batch_at(SYNTHETIC, 0, batch_size=ONE.batch_size, seq_len=ONE.seq_len, seed=0)
    state, metrics = trainer.train_step(
        trainer.init_state(), trainer.place_batch(x), trainer.place_batch(y)
    )
    return [np.asarray(a) for a in jax.tree.leaves(jax.device_get((state, metrics)))]


@pytest.mark.slow
def test_kept_then_read_gives_the_same_bits(cache):
    first = Trainer(MICRO_MODEL, ONE, None)
    assert first.compile().lowered == "traced and kept"
    assert len(list((cache / "steps").glob("*.jax_exported"))) == 1
    second = Trainer(MICRO_MODEL, dataclasses.replace(ONE, steps=99, workdir="elsewhere"), None)
    assert second.compile().lowered == "read"  # run-only fields are not part of the key
    plain = Trainer(MICRO_MODEL, ONE, None)  # not compiled: the plain jit
    for a, b, c in zip(_one_step(first), _one_step(second), _one_step(plain), strict=True):
        assert a.tobytes() == b.tobytes() == c.tobytes()


def test_key_follows_what_the_step_depends_on(cache):
    base = Trainer(MICRO_MODEL, ONE, None)
    keys = {base._step_key(base._abstract_args()).digest()}
    for other in (
        Trainer(MICRO_MODEL, dataclasses.replace(ONE, peak_lr=2e-2), None),
        Trainer(MICRO_MODEL, dataclasses.replace(ONE, batch_size=8), None),
        Trainer(MICRO_MODEL, dataclasses.replace(ONE, remat="block"), None),
        Trainer(dataclasses.replace(MICRO_MODEL, n_layers=4), ONE, None),
    ):
        keys.add(other._step_key(other._abstract_args()).digest())
    assert len(keys) == 5


def test_a_damaged_file_is_lowered_again(cache):
    Trainer(MICRO_MODEL, ONE, None).compile()
    (path,) = (cache / "steps").glob("*.jax_exported")
    path.write_bytes(path.read_bytes()[:100])
    assert Trainer(MICRO_MODEL, ONE, None).compile().lowered == "traced and kept"


@pytest.mark.slow
def test_a_step_export_refuses_trains_uncached(cache, monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("Cannot serialize this\nsecond line")

    monkeypatch.setattr(export, "export", refuse)
    trainer = Trainer(MICRO_MODEL, ONE, None)
    times = trainer.compile()
    assert times.lowered == "traced (not kept: Cannot serialize this)"
    assert times.trace_s is not None
    assert np.isfinite(_one_step(trainer)[-1]).all()
