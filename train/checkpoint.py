"""Checkpoints: orbax's `CheckpointManager` over `TrainState`, and the run's config beside it.

Orbax writes each step into a temporary folder and renames it only once every process has
finished writing, so an interrupted save never becomes the latest step: `latest_step` and
`restore` only see finished checkpoints. Restoring takes the target shardings of the current
mesh, so a run saved on 8 devices resumes on 4 (or on one device without a mesh).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding

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
        self.manager = ocp.CheckpointManager(self.directory, options=options)

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
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(target))
        return TrainState(**restored)

    def close(self) -> None:
        self.manager.close()


def _as_dict(state: TrainState) -> dict[str, Any]:
    return {
        "step": state.step,
        "params": state.params,
        "model_state": state.model_state,
        "opt_state": state.opt_state,
    }


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
