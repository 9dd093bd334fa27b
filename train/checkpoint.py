"""Checkpoints: orbax's `CheckpointManager` over `TrainState`, and the run's config beside it.

Orbax writes each step into a temporary folder and renames it only once every process has
finished writing, so an interrupted save never becomes the latest step: `latest_step` and
`restore` only see finished checkpoints. Restoring takes the target shardings of the current
mesh, so a run saved on 8 devices resumes on 4 (or on one device without a mesh).

Layouts: the model keeps its blocks stacked (`params["groups"]`, a leading [G] axis on every
leaf, and `params["tail"]`; see train/model.py). Checkpoints written while it kept one entry
per block (`params["blocks"][l]`, in the parameters, the router biases and the optimizer's
moments alike) are converted on restore: each block's arrays are read into their place in the
stack, the same values.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from train.config import ModelConfig, TrainConfig
from train.step import Trainer, TrainState

CONFIG_FILE = "config.json"


class Checkpoints:
    """The checkpoints of one run under `workdir/checkpoints`.

    Args:
      workdir: the run's folder.
      max_to_keep: finished checkpoints kept (the oldest are deleted).
    """

    def __init__(self, workdir: pathlib.Path | str, *, max_to_keep: int = 3):
        self.directory = pathlib.Path(workdir).resolve() / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=False, create=True
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
        )

    def latest_step(self) -> int | None:
        """The step of the latest finished checkpoint, or None."""
        return self.manager.latest_step()

    def save(self, state: TrainState) -> int:
        """Saves `state` under its step (blocking until it is finished); returns the step."""
        step = int(jax.device_get(state.step))
        self.manager.save(step, args=ocp.args.StandardSave(_as_dict(state)), force=True)
        self.manager.wait_until_finished()
        return step

    def restore(self, trainer: Trainer, step: int | None = None) -> TrainState:
        """The state of `step` (default: the latest) placed as `trainer`'s mesh wants it."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
        target = _as_dict(abstract_target(trainer))
        if self._per_block_layout(step):
            return _from_per_block(self.manager, step, target, trainer.model_cfg)
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(target))
        return TrainState(**restored)

    def _per_block_layout(self, step: int) -> bool:
        """Whether checkpoint `step` keeps one entry per block (`params["blocks"]`)."""
        params = self.manager.item_metadata(step).get("params", {})
        return "blocks" in params and "groups" not in params

    def close(self) -> None:
        self.manager.close()


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


def _from_per_block(manager, step: int, target: dict, model_cfg: ModelConfig) -> TrainState:
    """Restores checkpoint `step`, written in the per-block layout, into the stacked layout of
    `target` (a dict of `TrainState`'s fields)."""

    def is_state_params(node):
        return _is_params(node, "groups")

    old_target = jax.tree.map(
        lambda node: _per_block_target(node, model_cfg) if is_state_params(node) else node,
        target,
        is_leaf=is_state_params,
    )
    old = manager.restore(step, args=ocp.args.StandardRestore(old_target))
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


def write_config(workdir: pathlib.Path, model_cfg: ModelConfig, extra: dict[str, Any]) -> None:
    """Writes the model config (and `extra`, e.g. the train config) to workdir/config.json."""
    payload = {"model": model_cfg.to_json(), **extra}
    (workdir / CONFIG_FILE).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def read_model_config(workdir: pathlib.Path) -> ModelConfig:
    """The model config a run saved in workdir/config.json."""
    path = workdir / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {workdir} a training run's workdir?")
    return ModelConfig.from_json(json.loads(path.read_text())["model"])


def read_run_configs(workdir: pathlib.Path) -> tuple[ModelConfig, TrainConfig]:
    """The model and train configs a run saved in workdir/config.json."""
    path = workdir / CONFIG_FILE
    model_cfg = read_model_config(workdir)
    return model_cfg, TrainConfig(**json.loads(path.read_text())["train"])
