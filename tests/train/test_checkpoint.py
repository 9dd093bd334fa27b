"""Checkpoints that a disk fault cannot block: each kind of file of the latest step truncated,
deleted or corrupted, then sampled from (read-only) and resumed. The newest step whose arrays
read back as saved is used, a damaged one is reported in one line naming the file (or the
arrays), moved aside by a resumed run and never deleted, and the losses after the fallback
equal an uninterrupted run's, bit for bit."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re
import shutil
import sys
import types

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from tests.train.cases import MICRO_MODEL, micro_train
from train.checkpoint import SET_ASIDE_DIR, CheckpointDamaged, Checkpoints, checksums
from train.loop import train
from train.step import get_trainer, make_train_mesh

FAULTS = ("truncate", "delete", "corrupt")

# Each kind of file of a step folder (orbax with OCDBT, one process), found by this glob. The
# data files are damaged all at once: OCDBT groups the arrays into files differently from run
# to run, and parts of a file may never be read (a copy of the index, values superseded), so
# one file's fault may touch nothing that is read (test_every_file_of_the_step shows which).
FILE_KINDS = {
    "step metadata": "_CHECKPOINT_METADATA",  # orbax's, with our checksums
    "commit marker": "commit_success.txt",
    "item commit marker": "default/commit_success.txt",
    "tree metadata": "default/_METADATA",
    "shardings": "default/_sharding",
    "array metadata": "default/array_metadatas/process_0",
    "OCDBT manifest": "default/manifest.ocdbt",
    "OCDBT index": "default/d/*",
    "data files": "default/ocdbt.process_0/d/*",
    "process manifest": "default/ocdbt.process_0/manifest.ocdbt",
    "file sizes": "files.json",  # ours, only to name what changed
}

# Faults that leave every array readable as saved (orbax does not read the file on a local
# disk, or reads it only when present): the damaged step itself is used, its values checked.
HARMLESS = {
    *((kind, fault) for kind in ("commit marker", "item commit marker") for fault in FAULTS),
    *(("process manifest", fault) for fault in FAULTS),
    *(("file sizes", fault) for fault in FAULTS),
    ("shardings", "delete"),
    ("array metadata", "delete"),
}


def _damage(path: pathlib.Path, fault: str) -> None:
    """Truncates `path` to half, deletes it, or corrupts it: 8 bytes inverted in the middle of
    each eighth of the file (the size stays)."""
    data = bytearray(path.read_bytes())
    if fault == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif fault == "delete":
        path.unlink()
    else:
        for k in range(8):
            at = len(data) * (2 * k + 1) // 16
            data[at : at + 8] = bytes(b ^ 0xFF for b in data[at : at + 8])
        path.write_bytes(data)


def _snapshot(folder: pathlib.Path) -> dict[str, str]:
    """Every file under `folder` and a hash of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _run(workdir, *, resume=False, lines=None, **changes):
    cfg = micro_train(workdir, **changes)
    log = print if lines is None else lines.append
    return train(MICRO_MODEL, cfg, resume=resume, progress=False, sample=False, log=log)


# Its tests are all slow (./test.sh --all): the run takes ~30 s to make on 2 CPU cores.
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[pathlib.Path, list[float]]:
    """An uninterrupted run of 6 steps saved at 2, 4 and 6, with its step 6 removed: the
    template every test copies (a run whose last checkpoint is step 4), and its losses."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    losses = _run(workdir, steps=6, save_every=2).losses
    shutil.rmtree(workdir / "checkpoints" / "6")
    return workdir, losses


@pytest.fixture
def saved_run(uninterrupted) -> pathlib.Path:
    return uninterrupted[0]


@pytest.fixture
def whole_losses(uninterrupted) -> list[float]:
    return uninterrupted[1]


@pytest.fixture
def trainer():
    cfg = micro_train("unused", steps=6)
    return get_trainer(MICRO_MODEL, cfg, make_train_mesh(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_damaged_latest_step(tmp_path, saved_run, whole_losses, trainer, kind, fault):
    """Sampling (read-only) and resuming after a kind of file of step 4 is damaged: step 2 is
    used, with one line naming the file (or the arrays), unless the fault leaves step 4
    readable as saved; the resumed losses equal the uninterrupted run's."""
    shutil.copytree(saved_run, tmp_path, dirs_exist_ok=True)
    step_folder = tmp_path / "checkpoints" / "4"
    damaged = sorted(step_folder.glob(FILE_KINDS[kind]))
    assert damaged, FILE_KINDS[kind]
    names = [str(path.relative_to(step_folder)) for path in damaged]
    for path in damaged:
        _damage(path, fault)
    before = _snapshot(tmp_path)
    expected = 4 if (kind, fault) in HARMLESS else 2

    # What `sample` does: read-only, the newest good step.
    checkpoints = Checkpoints(tmp_path, read_only=True)
    restored = checkpoints.restore_newest_good(trainer)
    checkpoints.close()
    assert restored.step == expected and restored.checked
    assert _snapshot(tmp_path) == before  # nothing written, moved or deleted
    if expected == 2:
        (skipped,) = restored.skipped
        assert skipped.step == 4 and skipped.folder == step_folder
        assert "\n" not in str(skipped)
        if fault == "corrupt" and kind == "data files":
            # The same sizes: the checksums catch it, or a TensorStore error naming an array.
            assert re.match(r"\d+ of 58 arrays read back differ|[A-Z_]+: ", skipped.what)
        else:
            assert any(name in skipped.what for name in names), skipped.what

    # Resuming: from the same step, the damaged one moved aside (kept as it was).
    lines: list[str] = []
    resumed = _run(tmp_path, steps=6, save_every=2, resume=True, lines=lines)
    assert resumed.start_step == expected
    assert resumed.losses == whole_losses[expected:]
    set_aside = tmp_path / SET_ASIDE_DIR / "4"
    if expected == 2:
        assert _snapshot(set_aside) == {
            k.removeprefix("checkpoints/4/"): v
            for k, v in before.items()
            if k.startswith("checkpoints/4/")
        }
        moved = [line for line in lines if line.startswith("checkpoint step 4 is damaged: ")]
        assert len(moved) == 1 and f"moved to {set_aside}, not deleted" in moved[0], lines
        assert any(
            "at step 2, the newest good checkpoint: steps 3-4 are redone (2 steps)" in line
            for line in lines
        ), lines
    else:
        assert not set_aside.exists()
    checkpoints = Checkpoints(tmp_path, read_only=True)
    assert checkpoints.steps() == [2, 4, 6]
    assert int(checkpoints.restore(trainer).step) == 6  # the rewritten steps verify
    checkpoints.close()


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_every_file_of_the_step(tmp_path, saved_run, trainer, fault):
    """Each of OCDBT's files of step 4 in turn (manifests, index nodes, data files, whatever
    their role; the metadata files are covered above): the step is used if and only if its
    arrays read back bitwise as saved (checked here against the intact step, independently of
    the checksums); otherwise step 2 is used and the damage named."""
    source = saved_run / "checkpoints"
    checkpoints = Checkpoints(saved_run, read_only=True)
    intact = jax.device_get(checkpoints.restore(trainer, 4))
    checkpoints.close()
    outcomes = {}
    for path in sorted((source / "4" / "default").rglob("*")):
        if not path.is_file() or not (path.name == "manifest.ocdbt" or path.parent.name == "d"):
            continue
        name = str(path.relative_to(source / "4"))
        work = tmp_path / name.replace("/", "_")
        shutil.copytree(source, work / "checkpoints")
        _damage(work / "checkpoints" / "4" / name, fault)
        checkpoints = Checkpoints(work, read_only=True)
        restored = checkpoints.restore_newest_good(trainer)
        if restored.step == 4:
            for a, b in zip(jax.tree.leaves(intact), jax.tree.leaves(restored.state), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        else:
            assert restored.step == 2 and restored.skipped[0].step == 4
            # A failing read may also prove every array intact, in which case step 4 would
            # have passed: so here some array is unreadable or differs.
            try:
                checkpoints.restore(trainer, 4)
            except CheckpointDamaged:
                pass
            else:
                pytest.fail(f"{name} {fault}: step 4 skipped, yet it restores")
        checkpoints.close()
        outcomes[name] = restored.step if restored.step == 4 else restored.skipped[0].what
    print(json.dumps(outcomes, indent=1))
    assert any(step != 4 for step in outcomes.values())


@pytest.mark.slow
def test_no_good_step_is_an_error_and_writes_nothing(tmp_path, saved_run, trainer):
    shutil.copytree(saved_run, tmp_path, dirs_exist_ok=True)
    for step in (2, 4):
        (tmp_path / "checkpoints" / str(step) / "default" / "_METADATA").unlink()
    before = _snapshot(tmp_path)
    checkpoints = Checkpoints(tmp_path, read_only=True)
    with pytest.raises(
        ValueError,
        match=r"no good checkpoint in .*: step 4: default/_METADATA: missing; "
        r"step 2: default/_METADATA: missing",
    ):
        checkpoints.restore_newest_good(trainer)
    checkpoints.close()
    with pytest.raises(ValueError, match=r"^--resume: no good checkpoint .*--overwrite starts"):
        _run(tmp_path, steps=6, resume=True)
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
def test_resume_from_a_chosen_step(tmp_path, saved_run, whole_losses):
    """--resume-from 2 with a good step 4: step 4 is moved aside (not deleted), the run redoes
    steps 3-4 with the uninterrupted run's losses."""
    shutil.copytree(saved_run, tmp_path, dirs_exist_ok=True)
    step_4 = _snapshot(tmp_path / "checkpoints" / "4")
    lines: list[str] = []
    cfg = micro_train(tmp_path, steps=6, save_every=2)
    resumed = train(MICRO_MODEL, cfg, resume_from=2, progress=False, sample=False, log=lines.append)
    assert resumed.start_step == 2 and resumed.losses == whole_losses[2:]
    set_aside = tmp_path / SET_ASIDE_DIR / "4"
    assert _snapshot(set_aside) == step_4
    assert f"checkpoint step 4 is after --resume-from 2; moved to {set_aside}" in "\n".join(lines)
    assert any(line.endswith("at step 2: steps 3-4 are redone (2 steps)") for line in lines)


@pytest.mark.slow
def test_resume_from_a_missing_or_damaged_step_is_refused(tmp_path, saved_run):
    shutil.copytree(saved_run, tmp_path, dirs_exist_ok=True)
    (tmp_path / "checkpoints" / "2" / "default" / "manifest.ocdbt").unlink()
    before = _snapshot(tmp_path)
    cfg = micro_train(tmp_path, steps=6)
    with pytest.raises(ValueError, match=r"^--resume-from 3: no checkpoint of step 3 in .* 2, 4"):
        train(MICRO_MODEL, cfg, resume_from=3, progress=False, sample=False)
    with pytest.raises(
        ValueError,
        match=r"^--resume-from 2: checkpoint step 2 is damaged: default/manifest.ocdbt: "
        r"missing \(its folder: .*checkpoints/2\)$",
    ):
        train(MICRO_MODEL, cfg, resume_from=2, progress=False, sample=False)
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
def test_a_checksum_that_disagrees(tmp_path, saved_run, trainer):
    """One checksum in step 4's metadata changed (valid JSON, the same size): step 4 is
    skipped, naming the array."""
    shutil.copytree(saved_run, tmp_path, dirs_exist_ok=True)
    path = tmp_path / "checkpoints" / "4" / "_CHECKPOINT_METADATA"
    metadata = json.loads(path.read_text())
    value = metadata["custom_metadata"]["array_checksums"]["params.embed"]
    metadata["custom_metadata"]["array_checksums"]["params.embed"] = value[::-1]
    path.write_text(json.dumps(metadata))
    checkpoints = Checkpoints(tmp_path, read_only=True)
    restored = checkpoints.restore_newest_good(trainer)
    checkpoints.close()
    assert restored.step == 2
    assert restored.skipped[0].what == (
        "1 of 58 arrays read back differ from the checksums saved with them (params.embed)"
    )


@pytest.mark.slow
def test_arrays_of_another_shape_are_refused(saved_run):
    """A checkpoint read into a model of other shapes (a config.json swapped by hand: the
    config check cannot see it) fails on the stored shapes, before reading any array."""
    other = dataclasses.replace(MICRO_MODEL, moe=dataclasses.replace(MICRO_MODEL.moe, d_ff=64))
    cfg = micro_train("unused", steps=6)
    checkpoints = Checkpoints(saved_run, read_only=True)
    with pytest.raises(CheckpointDamaged, match=r"step 4 is damaged: \S+ is stored as float32\["):
        checkpoints.restore(get_trainer(other, cfg, make_train_mesh(cfg)), 4)
    checkpoints.close()


@pytest.mark.slow
def test_damaged_config_is_one_line(tmp_path, saved_run):
    shutil.copytree(saved_run, tmp_path, dirs_exist_ok=True)
    config = tmp_path / "config.json"
    config.write_text(config.read_text()[:100])
    with pytest.raises(ValueError, match=r"config.json is damaged: not valid JSON \(") as e:
        _run(tmp_path, steps=6, resume=True)
    assert "\n" not in str(e.value)


def test_checksums_follow_values_not_shardings():
    """The same values sharded two ways over 8 devices or on one device give one checksum;
    one element changed by one ulp, or two elements swapped, change it."""
    x = np.random.default_rng(0).standard_normal((8, 6, 8)).astype(np.float32)
    mesh = jax.make_mesh((1, 8), ("data", "expert"))
    sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("expert")))
    other = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, None, "expert")))
    one_ulp, swapped = x.copy(), x.copy()
    one_ulp[5, 3, 1] = np.nextafter(one_ulp[5, 3, 1], np.float32(np.inf))
    swapped[0, 0, 0], swapped[0, 0, 1] = x[0, 0, 1], x[0, 0, 0]
    sums = checksums({"a": sharded, "b": other, "c": x, "d": one_ulp, "e": swapped})
    assert sums["a"] == sums["b"] == sums["c"]
    assert len({sums["c"], sums["d"], sums["e"]}) == 3
    bf16 = checksums({"x": jax.numpy.asarray(x, jax.numpy.bfloat16)})
    assert len(bf16["x"]) == 16


def test_closed_loop_callbacks_are_dropped(monkeypatch):
    """After a failed read, TensorStore's late callbacks into orbax's closed event loop are
    dropped (nothing else): Python would print each with a traceback."""
    from train.checkpoint import _drop_closed_loop_callbacks

    reached = []
    monkeypatch.setattr(sys, "unraisablehook", reached.append)
    _drop_closed_loop_callbacks()
    _drop_closed_loop_callbacks()  # once only
    for error in (RuntimeError("Event loop is closed"), RuntimeError("other"), ValueError()):
        sys.unraisablehook(
            types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=None)
        )
    assert [str(u.exc_value) for u in reached] == ["other", ""]
