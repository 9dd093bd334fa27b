"""The training loop: resume equals uninterrupted (bitwise), resume on another device count,
NaN stops with a clear error and keeps the last good checkpoint, --check-determinism."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from tests.train.cases import MICRO_MODEL, micro_train
from train.checkpoint import Checkpoints
from train.loop import TrainingDiverged, WorkdirInUse, check_determinism, train
from train.metrics import read_metrics
from train.step import get_trainer, make_train_mesh


def _params(workdir, cfg) -> list[np.ndarray]:
    trainer = get_trainer(MICRO_MODEL, cfg, make_train_mesh(cfg))
    checkpoints = Checkpoints(workdir)
    state = checkpoints.restore(trainer)
    checkpoints.close()
    return [np.asarray(a) for a in jax.tree.leaves(jax.device_get(state.params))]


def _run(workdir, *, resume=False, **changes):
    cfg = micro_train(workdir, **changes)
    return cfg, train(MICRO_MODEL, cfg, resume=resume, progress=False, sample=False, log=print)


@pytest.mark.slow
def test_resume_equals_uninterrupted_and_other_device_count(tmp_path):
    """4 steps, then --resume to 6, gives bitwise the 6-step run's losses and parameters (same
    mesh); resuming the 4-step checkpoint on 4 devices instead of 8 continues close to it."""
    _, first = _run(tmp_path / "a", steps=4, devices=8)
    assert first.steps == 4 and len(first.losses) == 4
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    cfg, resumed = _run(tmp_path / "a", steps=6, devices=8, resume=True)
    assert resumed.start_step == 4 and resumed.steps == 6
    _, whole = _run(tmp_path / "b", steps=6, devices=8)

    # Bitwise: the losses (f32 values as Python floats) and every parameter.
    assert first.losses + resumed.losses == whole.losses
    for a, b in zip(_params(tmp_path / "a", cfg), _params(tmp_path / "b", cfg), strict=True):
        np.testing.assert_array_equal(a, b)
    # metrics.jsonl of the resumed run: steps 1..6 once each, with the same losses.
    records = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["loss"] for r in records] == whole.losses

    # Another device count: restored onto a 1 x 4 mesh, the same run within f32 rounding.
    _, four = _run(tmp_path / "c", steps=6, devices=4, resume=True)
    assert four.start_step == 4
    np.testing.assert_allclose(four.losses, whole.losses[4:], rtol=1e-5)
    print("8 -> 4 devices: losses", four.losses, "vs", whole.losses[4:])


def test_nan_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    def poison(step, state):
        if step == 3:  # before the 4th step: the embedding becomes NaN
            embed = state.params["embed"]
            state.params["embed"] = jax.numpy.full_like(embed, np.nan)
        return state

    cfg = micro_train(tmp_path, steps=6, save_every=2)
    with pytest.raises(
        TrainingDiverged, match=r"diverged at step 4: .*last good checkpoint is step 2"
    ):
        train(MICRO_MODEL, cfg, progress=False, sample=False, state_hook=poison)
    # A save interrupted half-way (orbax's temporary folder, never renamed) is not a checkpoint.
    half = tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-1764489600000000"
    half.mkdir()
    (half / "partial").write_bytes(b"\0" * 16)
    checkpoints = Checkpoints(tmp_path)
    assert checkpoints.manager.all_steps() == [2]
    assert checkpoints.latest_step() == 2
    state = checkpoints.restore(get_trainer(MICRO_MODEL, cfg, make_train_mesh(cfg)))
    checkpoints.close()
    assert int(state.step) == 2
    assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves(jax.device_get(state.params)))
    # The diverged step's record was not logged.
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_fresh_run_refuses_a_used_workdir(tmp_path):
    _run(tmp_path, steps=1)
    with pytest.raises(WorkdirInUse, match="--resume continues it"):
        _run(tmp_path, steps=1)
    # Resuming with another model is refused before anything is compiled or written.
    other = dataclasses.replace(MICRO_MODEL, moe_every=1)
    with pytest.raises(
        ValueError, match=r"has another model config: moe_every=2 saved, 1 asked; use the same"
    ):
        train(other, micro_train(tmp_path, steps=2), resume=True, progress=False, sample=False)


def test_resume_past_steps_is_refused_and_at_steps_trains_nothing(tmp_path):
    from train.__main__ import _done_line

    _run(tmp_path, steps=2)
    config = (tmp_path / "config.json").read_text()
    with pytest.raises(ValueError, match=r"is at step 2, past steps=1: ask for more steps"):
        _run(tmp_path, steps=1, resume=True)
    assert (tmp_path / "config.json").read_text() == config
    _, again = _run(tmp_path, steps=2, resume=True)
    assert again.start_step == again.steps == 2 and again.losses == []
    assert _done_line(again).startswith("done: nothing to train, the run is at step 2 already")


def test_check_determinism(tmp_path):
    report = check_determinism(MICRO_MODEL, micro_train(tmp_path, steps=3))
    assert report.equal, report
    assert report.first_difference is None and len(report.losses[0]) == 3


def test_per_block_checkpoint_is_converted(tmp_path):
    """A checkpoint written when the model kept one entry per block (params["blocks"][l]; the
    fixture: step 2 of the micro model on 8 devices, with that run's losses of steps 1-3)
    resumes into the stacked layout: step 3's loss is that run's step 3, and `sample` reads it."""
    fixture = pathlib.Path(__file__).parent / "data" / "per_block_checkpoint"
    shutil.copytree(fixture, tmp_path, dirs_exist_ok=True)
    old_losses = json.loads((fixture / "losses.json").read_text())["losses"]
    lines: list[str] = []
    cfg = micro_train(tmp_path, steps=3, devices=8, save_every=2)
    # Its config.json has the MoE layer's flat performance fields of that time.
    with pytest.warns(DeprecationWarning, match="fused_residuals -> options.residuals"):
        resumed = train(
            MICRO_MODEL, cfg, resume=True, progress=False, sample=False, log=lines.append
        )
    assert resumed.start_step == 2
    assert any(
        line.endswith("at step 2 (saved without checksums: its values are not checked)")
        for line in lines
    ), lines
    np.testing.assert_allclose(resumed.losses, old_losses[2:], rtol=1e-5)
    checkpoints = Checkpoints(tmp_path)
    assert checkpoints.manager.all_steps() == [2, 3]
    checkpoints.close()
