"""Checkpoints: orbax's `CheckpointManager` over `TrainState`, and the run's config beside it.

Orbax writes each step into a temporary folder and renames it only once every process has
finished writing, so an interrupted save never becomes the latest step: `latest_step` and
`restore` only see finished checkpoints. Restoring takes the target shardings of the current
mesh, so a run saved on 8 devices resumes on 4 (or on one device without a mesh).

Verification: a finished step can still be damaged later (a disk fault, a file truncated,
deleted or overwritten). Each save records, in orbax's step metadata (`_CHECKPOINT_METADATA`,
written inside the temporary folder, so as atomically as the arrays), a checksum of every
array's values, and after the save a list of the step folder's files and their sizes
(`files.json`, used only to name what changed). Restoring a step checks, in order: its JSON
metadata files parse, every stored array's shape and dtype match the target, orbax reads every
array, and every array's checksum matches the one saved. A step that fails raises
`CheckpointDamaged` with one line (the step, the file or array, what is wrong);
`restore_newest_good` then tries the next older step. Nothing is ever deleted here. Orbax and
asyncio log a traceback per array while reading a damaged step (tens of thousands of lines);
they are silenced while reading.

Layouts: the model keeps its blocks stacked (`params["groups"]`, a leading [G] axis on every
leaf, and `params["tail"]`; see train/model.py). Checkpoints written while it kept one entry
per block (`params["blocks"][l]`, in the parameters, the router biases and the optimizer's
moments alike) are converted on restore: each block's arrays are read into their place in the
stack, the same values. Those, and any written before checksums were kept, are checked for
shapes and readability only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from train.config import ModelConfig, TrainConfig
from train.step import Trainer, TrainState

CONFIG_FILE = "config.json"
FILES_FILE = "files.json"  # in each step folder: its files' sizes after the save
SET_ASIDE_DIR = "checkpoints_set_aside"  # in the workdir: steps a resumed run writes again
_STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's, holding our checksums
_CHECKSUMS = "array_checksums"  # their key in orbax's custom metadata
_ITEM_JSON = ("default/_METADATA",)  # orbax's JSON files a step must have
_OPTIONAL_JSON = ("default/_sharding",)  # and those it reads when present


class CheckpointDamaged(ValueError):
    """A finished checkpoint step that cannot be used.

    Attributes:
      step: the step.
      folder: the step's folder (the message says how to remove it; nothing deletes it).
      what: one line: the file or array, and what is wrong with it.
    """

    def __init__(self, step: int, folder: pathlib.Path, what: str):
        self.step, self.folder, self.what = step, folder, what
        super().__init__(f"checkpoint step {step} is damaged: {what}")


class RunConfigError(ValueError):
    """The workdir's config.json is missing or unreadable."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Restored:
    """A restored state and how its step was chosen.

    Attributes:
      state: the state, placed as the trainer's mesh wants it.
      step: its step.
      newest: the newest finished step in the folder (greater than `step` when newer steps
        were skipped or passed over).
      skipped: the damaged steps newer than `step`, newest first.
      checked: whether its values were checked against checksums (False for a checkpoint
        written before checksums were kept).
    """

    state: TrainState
    step: int
    newest: int
    skipped: tuple[CheckpointDamaged, ...]
    checked: bool


class _Unreadable(Exception):
    """A step's file that fails a check made before orbax reads it; the message says which."""


class Checkpoints:
    """The checkpoints of one run under `workdir/checkpoints`.

    Args:
      workdir: the run's folder.
      max_to_keep: finished checkpoints kept (the oldest are deleted).
      read_only: only read: no folder is created and nothing is removed (for `sample`, and for
        choosing the step a run resumes from before the run is accepted).
    """

    def __init__(
        self, workdir: pathlib.Path | str, *, max_to_keep: int = 3, read_only: bool = False
    ):
        self.directory = pathlib.Path(workdir).resolve() / "checkpoints"
        self.manager = None
        if read_only and not self.directory.is_dir():
            return
        with _quiet_orbax():  # it reads every step's metadata, damaged or not
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=False,
                create=not read_only,
                read_only=read_only,
                # What a save killed half-way leaves (its temporary folder) is never a
                # checkpoint.
                cleanup_tmp_directories=not read_only,
            )
            self.manager = ocp.CheckpointManager(
                self.directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
            )

    def steps(self) -> list[int]:
        """The finished steps, oldest first."""
        return [] if self.manager is None else sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        """The step of the latest finished checkpoint, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def step_folder(self, step: int) -> pathlib.Path:
        return self.directory / str(step)

    def save(self, state: TrainState) -> int:
        """Saves `state` under its step (blocking until it is finished) with its arrays'
        checksums, then lists the step folder's files (process 0); returns the step."""
        step = int(jax.device_get(state.step))
        tree = _as_dict(state)
        self.manager.save(
            step,
            args=ocp.args.StandardSave(tree),
            force=True,
            custom_metadata={_CHECKSUMS: checksums(tree)},
        )
        self.manager.wait_until_finished()
        if jax.process_index() == 0:
            _write_file_sizes(self.step_folder(step))
        return step

    def restore(self, trainer: Trainer, step: int | None = None) -> TrainState:
        """The state of `step` (default: the latest), verified and placed as `trainer`'s mesh
        wants it.

        Raises:
          FileNotFoundError: there is no finished checkpoint.
          CheckpointDamaged: the step fails verification.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
        return self._verified(trainer, step)[0]

    def restore_newest_good(self, trainer: Trainer, *, step: int | None = None) -> Restored:
        """The newest step that passes verification, the damaged newer ones skipped; or
        `step`, chosen by hand, which must pass.

        Raises:
          FileNotFoundError: there is no finished checkpoint.
          ValueError: `step` is not a finished checkpoint, or no step passes (the message
            says what is wrong with each).
          CheckpointDamaged: `step` fails verification.
        """
        steps = self.steps()
        if not steps:
            raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
        if step is not None:
            if step not in steps:
                raise ValueError(
                    f"no checkpoint of step {step} in {self.directory} (its steps: "
                    f"{', '.join(map(str, steps))})"
                )
            state, checked = self._verified(trainer, step)
            return Restored(state=state, step=step, newest=steps[-1], skipped=(), checked=checked)
        skipped = []
        for candidate in reversed(steps):
            try:
                state, checked = self._verified(trainer, candidate)
            except CheckpointDamaged as e:
                skipped.append(e)
                continue
            return Restored(
                state=state,
                step=candidate,
                newest=steps[-1],
                skipped=tuple(skipped),
                checked=checked,
            )
        raise ValueError(
            f"no good checkpoint in {self.directory}: "
            + "; ".join(f"step {e.step}: {e.what}" for e in skipped)
        )

    def _verified(self, trainer: Trainer, step: int) -> tuple[TrainState, bool]:
        """Restores `step` and checks it (see the module); returns (state, whether checksums
        were checked). Every process takes part; they agree on the verdict."""
        folder = self.step_folder(step)
        state, saved, error = None, None, None
        try:
            saved = _saved_checksums(folder)
            for name in _ITEM_JSON:
                _read_json(folder, name)
            for name in (*_OPTIONAL_JSON, *_array_metadata_files(folder)):
                if (folder / name).exists():
                    _read_json(folder, name)
            state = self._read(trainer, step)
        except _Unreadable as e:
            error = str(e)
        except Exception as e:  # orbax and TensorStore raise many kinds; all mean unreadable
            error = _describe(e, folder)
            _drop_closed_loop_callbacks()
        if not _every_process_agrees(error is None):
            error = error or "another process could not read it"
        if error is None and saved is not None:
            error = _checksum_mismatch(saved, checksums(_as_dict(state)))
        if error is not None:
            raise CheckpointDamaged(step, folder, _changed_files(folder) or error)
        return state, saved is not None

    def _read(self, trainer: Trainer, step: int) -> TrainState:
        """Reads `step` into `trainer`'s state after checking the stored arrays' shapes and
        dtypes against it (converting the per-block layout)."""
        target = _as_dict(abstract_target(trainer))
        with _quiet_orbax():
            stored = self.manager.item_metadata(step)
            if stored is None:
                raise _Unreadable("default/_METADATA: orbax finds no arrays in it")
            per_block = "blocks" in stored.get("params", {}) and "groups" not in stored["params"]
            if per_block:
                old_target = _per_block_state_target(target, trainer.model_cfg)
                _check_stored_arrays(stored, old_target)
                old = self.manager.restore(step, args=ocp.args.StandardRestore(old_target))
                return _from_per_block(old, target, trainer.model_cfg)
            _check_stored_arrays(stored, target)
            return TrainState(**self.manager.restore(step, args=ocp.args.StandardRestore(target)))

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()


def set_aside(directory: pathlib.Path, steps: Sequence[int], into: pathlib.Path) -> dict:
    """Moves the folders of `steps` from the checkpoints folder `directory` to `into/<step>`
    (`<step>.1`, ... where taken); returns {step: where it went}. A run resuming from an older
    step writes these steps again, so they must leave the folder; they are kept, not deleted.
    Process 0 only."""
    moved = {}
    for step in steps:
        dest, n = into / str(step), 0
        while dest.exists():
            n += 1
            dest = into / f"{step}.{n}"
        into.mkdir(parents=True, exist_ok=True)
        (directory / str(step)).rename(dest)
        moved[step] = dest
    return moved


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Silences the loggers of orbax (absl's) and asyncio: reading a damaged step makes them
    log a traceback for every array (tens of thousands of lines); the caller reports the
    failure in one line instead."""
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    before = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in zip(loggers, before, strict=True):
            logger.disabled = disabled


def _drop_closed_loop_callbacks() -> None:
    """After a failed read, TensorStore can finish reads it had started once orbax has closed
    its event loop; their callbacks then raise "Event loop is closed" where nothing can catch
    it, and Python prints each as "Exception ignored in ..." with a traceback (pytest makes it
    an error in whatever test runs then). This drops those, and only those: every other
    unraisable exception still goes to the hook that was in place. Installed once."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_callbacks", False):
        return

    def hook(unraisable):
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        previous(unraisable)

    hook.drops_closed_loop_callbacks = True
    sys.unraisablehook = hook


def _every_process_agrees(ok: bool) -> bool:
    """Whether `ok` holds on every process (a file can fail on one process's reads only)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


# --- Checks of a step's files ---------------------------------------------------------------


def _read_json(folder: pathlib.Path, name: str) -> Any:
    """The JSON file `folder/name`, or `_Unreadable` naming it and what is wrong."""
    try:
        text = (folder / name).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _Unreadable(f"{name}: missing") from None
    except UnicodeDecodeError as e:
        raise _Unreadable(f"{name}: not UTF-8 text (at byte {e.start})") from None
    except OSError as e:
        raise _Unreadable(f"{name}: cannot be read ({e.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _Unreadable(f"{name}: not valid JSON ({e})") from None


def _array_metadata_files(folder: pathlib.Path) -> list[str]:
    """orbax's per-process array metadata files (JSON) of the step."""
    under = folder / "default" / "array_metadatas"
    return sorted(str(p.relative_to(folder)) for p in under.glob("*")) if under.is_dir() else []


def _saved_checksums(folder: pathlib.Path) -> dict[str, str] | None:
    """The arrays' checksums saved in the step's orbax metadata; None for a step saved
    without them."""
    metadata = _read_json(folder, _STEP_METADATA)
    custom = metadata.get("custom_metadata") if isinstance(metadata, dict) else None
    if not isinstance(custom, dict) and custom is not None:
        raise _Unreadable(f"{_STEP_METADATA}: its custom_metadata is not a JSON object")
    saved = (custom or {}).get(_CHECKSUMS)
    if saved is not None and not isinstance(saved, dict):
        raise _Unreadable(f"{_STEP_METADATA}: its {_CHECKSUMS} is not a JSON object")
    return saved


def _check_stored_arrays(stored: Any, target: dict) -> None:
    """Every array of `target` is in orbax's metadata `stored` (the tree from
    default/_METADATA, each array's shape and dtype from its zarr metadata), with its shape
    and dtype."""
    have = _named_leaves(stored)
    for name, want in _named_leaves(target).items():
        if name not in have:
            raise _Unreadable(f"no array {name} is stored")
        got = have[name]
        if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
            raise _Unreadable(
                f"{name} is stored as {np.dtype(got.dtype)}{list(got.shape)}, expected "
                f"{np.dtype(want.dtype)}{list(want.shape)}"
            )


_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")  # TensorStore's errors start with a status code


def _describe(error: BaseException, folder: pathlib.Path) -> str:
    """One line from an error of orbax or TensorStore: the most specific message of its
    chain (TensorStore's, which names the file or array), paths relative to the step."""
    chain: list[BaseException] = []
    while error is not None and all(error is not seen for seen in chain):
        chain.append(error)
        error = error.__cause__ or error.__context__
    best = next((e for e in chain if _STATUS.match(str(e))), chain[0])
    text = (str(best).splitlines() or [""])[0]
    text = text.split(" [tensorstore_spec=")[0].split(" See full TensorStore details")[0]
    text = text.replace(f"{folder}/", "")
    if not _STATUS.match(text):
        text = f"{type(best).__name__}: {text}"
    return text[:300]


def _write_file_sizes(folder: pathlib.Path) -> None:
    """Writes `folder/files.json`: each file of the step and its size (written after orbax
    finished the step: a run killed before it leaves the step without one, which is fine)."""
    sizes = {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not path.name.startswith(FILES_FILE)
    }
    partial = folder / f"{FILES_FILE}.partial"
    partial.write_text(json.dumps({"sizes": sizes}, indent=1, sort_keys=True) + "\n")
    os.replace(partial, folder / FILES_FILE)


def _changed_files(folder: pathlib.Path) -> str:
    """The step's files missing or resized since the save (per files.json), as one line;
    "" when none is, or when files.json itself is unreadable."""
    try:
        sizes = json.loads((folder / FILES_FILE).read_text(encoding="utf-8"))["sizes"]
        saved = {str(name): int(size) for name, size in sizes.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""
    problems = []
    for name, size in sorted(saved.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{name}: {path.stat().st_size} bytes, {size} when saved")
    if len(problems) > 3:
        problems = [*problems[:3], f"and {len(problems) - 3} more files"]
    return "; ".join(problems)


# --- Checksums of the arrays' values -----------------------------------------------------------


def _fmix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 that mixes every bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 words (one per element; two for 8-byte dtypes, on a trailing
    axis)."""
    width = np.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if width < 4:
        narrow = {1: jnp.uint8, 2: jnp.uint16}[width]
        return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _array_checksum(x: jax.Array) -> jax.Array:
    """Two uint32 sums over the elements of mix(bits ^ mix(position)), [2].

    Integer sums wrap and do not depend on their order, so the result is the same on any mesh
    and any sharding (a run saved on 8 devices is checked on 4). Changing one element always
    changes the first sum (the mixing is a bijection); the second makes two compensating
    changes as unlikely as 2^-64."""
    words = _words(x)
    position = jnp.zeros(words.shape, jnp.uint32)
    for axis, size in enumerate(words.shape):
        position = position * jnp.uint32(size) + jax.lax.broadcasted_iota(
            jnp.uint32, words.shape, axis
        )
    h = _fmix(words ^ _fmix(position + jnp.uint32(0x9E3779B9)))
    first = jnp.sum(h, dtype=jnp.uint32)
    second = jnp.sum(_fmix(h + jnp.uint32(0x7F4A7C15)), dtype=jnp.uint32)
    return jnp.stack([first, second])


_tree_checksums = jax.jit(lambda tree: jax.tree.map(_array_checksum, tree))


def checksums(tree: Any) -> dict[str, str]:
    """{array name: checksum as 16 hex digits} of a tree of arrays (every process takes part
    when they are sharded over several)."""
    sums = jax.device_get(_tree_checksums(tree))
    return {
        name: f"{int(pair[0]):08x}{int(pair[1]):08x}" for name, pair in _named_leaves(sums).items()
    }


def _checksum_mismatch(saved: dict[str, str], restored: dict[str, str]) -> str | None:
    """None when every restored array has its saved checksum; else one line naming them."""
    differ = [name for name, value in restored.items() if saved.get(name) != value]
    if not differ:
        return None
    shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    return (
        f"{len(differ)} of {len(restored)} arrays read back differ from the checksums saved "
        f"with them ({shown})"
    )


def _leaf_name(path: tuple) -> str:
    """A pytree path as orbax names the array: keys and indices joined by dots."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def _named_leaves(tree: Any) -> dict[str, Any]:
    return {_leaf_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


# --- The state and its older layout ----------------------------------------------------------


def _as_dict(state: TrainState) -> dict[str, Any]:
    return {
        "step": state.step,
        "params": state.params,
        "model_state": state.model_state,
        "opt_state": state.opt_state,
    }


def _is_params(node: Any, key: str) -> bool:
    """A params-shaped dict (the parameters, the router biases, an optimizer moment) of the
    layout that `key` ("groups" or "blocks") marks."""
    return isinstance(node, dict) and key in node


def _unstacked(a: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """A stacked leaf's one entry: the leading axis dropped, from the shape and the sharding."""
    sharding = a.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=sharding)


def _block_sources(model_cfg: ModelConfig) -> tuple[list[list[int]], list[int], list[int]]:
    """Where each stacked entry comes from in the per-block layout: (for each dense position
    j of a group, the block of each group; the MoE block of each group; the tail's blocks)."""
    every, groups = model_cfg.moe_every, model_cfg.num_moe_layers
    dense = [[g * every + j for g in range(groups)] for j in range(every - 1)]
    moe = [g * every + every - 1 for g in range(groups)]
    tail = list(range(groups * every, model_cfg.n_layers))
    return dense, moe, tail


def _per_block_target(params: dict, model_cfg: ModelConfig) -> dict:
    """A params-shaped target of the stacked layout -> the same in the per-block layout."""
    dense, moe, tail = _block_sources(model_cfg)
    groups, blocks = params.get("groups", {}), {}
    for j, stacked in groups.get("dense", {}).items():
        blocks.update({layer: jax.tree.map(_unstacked, stacked) for layer in dense[j]})
    if "moe" in groups:
        blocks.update({layer: jax.tree.map(_unstacked, groups["moe"]) for layer in moe})
    blocks.update({tail[i]: tree for i, tree in params.get("tail", {}).items()})
    rest = {k: v for k, v in params.items() if k not in ("groups", "tail")}
    return {**rest, "blocks": blocks}


def _stack_blocks(old: dict, target: dict, model_cfg: ModelConfig) -> dict:
    """A params-shaped tree in the per-block layout -> the stacked layout of `target`, each
    stack placed with the target's sharding."""
    dense, moe, tail = _block_sources(model_cfg)
    blocks = {int(k): v for k, v in old["blocks"].items()}

    def stack(layers, like):
        trees = [blocks[layer] for layer in layers]
        return jax.tree.map(lambda t, *xs: jax.device_put(jnp.stack(xs), t.sharding), like, *trees)

    groups = target.get("groups", {})
    new_groups = {}
    if "dense" in groups:
        new_groups["dense"] = {j: stack(dense[j], like) for j, like in groups["dense"].items()}
    if "moe" in groups:
        new_groups["moe"] = stack(moe, groups["moe"])
    new = {k: v for k, v in old.items() if k != "blocks"} | {"groups": new_groups}
    if "tail" in target:
        new["tail"] = {i: blocks[tail[i]] for i in target["tail"]}
    return new


def _per_block_state_target(target: dict, model_cfg: ModelConfig) -> dict:
    """A target of the stacked layout (a dict of `TrainState`'s fields) -> the same in the
    per-block layout, as such a checkpoint stores it."""

    def is_state_params(node):
        return _is_params(node, "groups")

    return jax.tree.map(
        lambda node: _per_block_target(node, model_cfg) if is_state_params(node) else node,
        target,
        is_leaf=is_state_params,
    )


def _from_per_block(old: dict, target: dict, model_cfg: ModelConfig) -> TrainState:
    """A state read in the per-block layout -> the stacked layout of `target` (a dict of
    `TrainState`'s fields)."""
    restored = jax.tree.map(
        lambda node, like: (
            _stack_blocks(node, like, model_cfg) if _is_params(node, "blocks") else node
        ),
        old,
        target,
        is_leaf=lambda node: _is_params(node, "blocks"),
    )
    return TrainState(**restored)


def abstract_target(trainer: Trainer) -> TrainState:
    """`trainer`'s state as ShapeDtypeStructs carrying the shardings to restore into."""
    if trainer.state_shardings is None:
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, trainer.abstract_state)
    else:
        shardings = trainer.state_shardings
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        trainer.abstract_state,
        shardings,
    )


# --- The run's config --------------------------------------------------------------------------


def write_config(workdir: pathlib.Path, model_cfg: ModelConfig, extra: dict[str, Any]) -> None:
    """Writes the model config (and `extra`, e.g. the train config) to workdir/config.json."""
    payload = {"model": model_cfg.to_json(), **extra}
    (workdir / CONFIG_FILE).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def _read_config_file(workdir: pathlib.Path) -> dict[str, Any]:
    """workdir/config.json's content; `RunConfigError` naming the file when it is missing or
    not JSON."""
    path = workdir / CONFIG_FILE
    if not path.is_file():
        raise RunConfigError(f"{path} does not exist: is {workdir} a training run's workdir?")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunConfigError(f"{path} is damaged: not valid JSON ({e})") from None
    if not isinstance(payload, dict):
        raise RunConfigError(f"{path} is damaged: not a JSON object")
    return payload


def read_model_config(workdir: pathlib.Path) -> ModelConfig:
    """The model config a run saved in workdir/config.json."""
    payload = _read_config_file(workdir)
    try:
        return ModelConfig.from_json(payload["model"])
    except (KeyError, TypeError) as e:
        raise RunConfigError(
            f"{workdir / CONFIG_FILE} is damaged: no valid model config ({e!r})"
        ) from None


def read_run_configs(workdir: pathlib.Path) -> tuple[ModelConfig, TrainConfig]:
    """The model and train configs a run saved in workdir/config.json."""
    model_cfg = read_model_config(workdir)
    try:
        return model_cfg, TrainConfig(**_read_config_file(workdir)["train"])
    except (KeyError, TypeError) as e:
        raise RunConfigError(
            f"{workdir / CONFIG_FILE} is damaged: no valid train config ({e!r})"
        ) from None
