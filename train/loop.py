"""The training loop: mesh, model and state (fresh or restored), steps, evaluation, metrics,
checkpoints, and at the end the plot and a few sampled lines.

    summary = train(PRESETS["tiny"].model, PRESETS["tiny"].train)

Batch `step` is a pure function of (data, seed, step) (`data.batch_at`), and the state holds
everything else, so a run stopped at step n and resumed to m computes what one run of m steps
computes. Multi-process: every process runs this same function; the mesh spans all processes'
devices, each process feeds its rows of every batch, and only process 0 writes logs, the plot
and the samples (orbax coordinates the checkpoints).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import mok_jax
from train import data as data_lib
from train.checkpoint import (
    SET_ASIDE_DIR,
    CheckpointDamaged,
    Checkpoints,
    Restored,
    read_model_config,
    set_aside,
    write_config,
)
from train.config import ModelConfig, TrainConfig
from train.metrics import RunLogger
from train.model import model_flops_per_token, peak_flops
from train.plots import plot_run
from train.sample import format_samples, generate, host_params
from train.step import TrainState, get_trainer, make_train_mesh

PLOT_FILE = "metrics.png"
SAMPLES_FILE = "samples.txt"
SAMPLE_TEMPERATURE = 0.8
SAMPLE_BYTES = 240
SAMPLE_PROMPTS = 3


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or Inf; the checkpoints before it stay."""

    def __init__(self, step: int, loss: float, grad_norm: float, last_checkpoint: int | None):
        self.step = step
        self.last_checkpoint = last_checkpoint
        kept = (
            f"the last good checkpoint is step {last_checkpoint}"
            if last_checkpoint is not None
            else "no checkpoint was saved before it"
        )
        super().__init__(
            f"training diverged at step {step}: loss={loss}, grad_norm={grad_norm} "
            f"(not finite); {kept}"
        )


class WorkdirInUse(ValueError):
    """A fresh run was asked for in a workdir that holds another run's checkpoints."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Summary:
    """What a run reports at the end.

    Attributes:
      start_step: the step the run started from (0, or the restored checkpoint's).
      steps: the step it ended at.
      final_loss: the train loss of the last step (None when no step ran).
      final_eval_loss: the last evaluation's loss (None without evaluation).
      tokens_per_s: mean throughput over the steps after the first.
      mfu: tokens_per_s as a share of the devices' dense bf16 peak (None where unknown).
      peak_memory_bytes: the most memory the first device held (None where it does not say).
      time_s: wall time of the whole call.
      losses: the train loss of every step run, in order.
      workdir: the run's folder.
      samples: the sampled text (None on processes other than 0).
    """

    start_step: int
    steps: int
    final_loss: float | None
    final_eval_loss: float | None
    tokens_per_s: float | None
    mfu: float | None
    peak_memory_bytes: int | None
    time_s: float
    losses: list[float]
    workdir: pathlib.Path
    samples: str | None


def _expert_load(tokens_per_expert: np.ndarray) -> tuple[list[list[float]], list[float]]:
    """tokens_per_expert [L, E] -> (each expert's share per layer, max over mean per layer)."""
    counts = tokens_per_expert.astype(np.float64)
    totals = np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
    shares = counts / totals
    mean = np.maximum(counts.mean(axis=1), 1e-12)
    return shares.tolist(), (counts.max(axis=1) / mean).tolist()


def _check_workdir(workdir: pathlib.Path, *, resume: bool, overwrite: bool) -> None:
    """Checks, creating nothing, that `workdir` can be the run's folder: it is a folder or
    can become one, and a fresh run does not start over another run's checkpoints."""
    for folder in (workdir, *workdir.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "" if folder == workdir else f": {folder} is a file"
                raise ValueError(f"workdir={str(workdir)!r} is not a folder{where}")
            break
    checkpoints = workdir / "checkpoints"
    if not (resume or overwrite) and checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise WorkdirInUse(
            f"{workdir} already holds a run's checkpoints: --resume continues it, --overwrite "
            "starts over (deleting it), or choose another --workdir"
        )


def _prepare_workdir(workdir: pathlib.Path, *, overwrite: bool) -> None:
    """Makes the folder (once the run is accepted); with `overwrite`, deletes a previous run's
    outputs in it."""
    if overwrite and jax.process_index() == 0:
        for name in ("checkpoints", "tensorboard", SET_ASIDE_DIR):
            shutil.rmtree(workdir / name, ignore_errors=True)
        for name in ("metrics.jsonl", PLOT_FILE, SAMPLES_FILE, "config.json"):
            (workdir / name).unlink(missing_ok=True)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("train: workdir prepared")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"workdir={str(workdir)!r} cannot be made: {e.strerror}") from None


def _config_differences(saved: dict, asked: dict, prefix: str = "") -> list[str]:
    """'field=saved saved, asked asked' for each field that differs (nested configs' fields
    dotted, e.g. moe.num_experts)."""
    differences = []
    for key in sorted(saved.keys() | asked.keys()):
        a, b = saved.get(key), asked.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            differences += _config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            differences.append(f"{prefix}{key}={a!r} saved, {b!r} asked")
    return differences


def _how_it_runs_aside(model_cfg: ModelConfig) -> ModelConfig:
    """The model's function: its MoE layers' implementation and options left at their
    defaults (a run may resume on another device, or with other options)."""
    moe = dataclasses.replace(model_cfg.moe, implementation="auto", options=mok_jax.MoEOptions())
    return dataclasses.replace(model_cfg, moe=moe)


def _check_same_model(workdir: pathlib.Path, model_cfg: ModelConfig, flag: str) -> None:
    """Refuses to resume the run in `workdir` with another model, naming the fields that
    differ. How the MoE layers run (implementation, options) may differ."""
    saved = _how_it_runs_aside(read_model_config(workdir))
    model_cfg = _how_it_runs_aside(model_cfg)
    if saved != model_cfg:
        differences = _config_differences(saved.to_json(), model_cfg.to_json())
        raise ValueError(
            f"{flag}: the run in {workdir} has another model config: "
            f"{'; '.join(differences)}; use the same preset and model flags"
        )


def _resume_point(
    workdir: pathlib.Path, trainer, train_cfg: TrainConfig, resume_from: int | None, say
) -> Restored | None:
    """The state a resumed run starts from: the newest checkpoint that passes verification
    (or `resume_from`'s); None when there is no checkpoint. Reads only: the run is not
    accepted yet."""
    checkpoints = Checkpoints(workdir, read_only=True)
    flag = "--resume" if resume_from is None else f"--resume-from {resume_from}"
    try:
        if not checkpoints.steps():
            if resume_from is not None:
                raise ValueError(f"{flag}: no checkpoint in {checkpoints.directory}")
            say(f"--resume: no checkpoint in {checkpoints.directory}; starting from step 0")
            return None
        _check_same_model(workdir, trainer.model_cfg, flag)
        try:
            restored = checkpoints.restore_newest_good(trainer, step=resume_from)
        except CheckpointDamaged as e:
            raise ValueError(f"{flag}: {e} (its folder: {e.folder})") from None
        except ValueError as e:
            advice = "; --overwrite starts over" if resume_from is None else ""
            raise ValueError(f"{flag}: {e}{advice}") from None
    finally:
        checkpoints.close()
    if restored.step > train_cfg.steps:
        raise ValueError(
            f"{flag}: the run in {workdir} is at step {restored.step}, past "
            f"steps={train_cfg.steps}: ask for more steps"
        )
    return restored


def _set_aside_newer(workdir: pathlib.Path, restored: Restored, say) -> None:
    """Moves the steps after the one resumed from out of the checkpoints folder (the run
    writes them again) and says, one line each, why and where each went."""
    checkpoints = Checkpoints(workdir, read_only=True)
    newer = [step for step in checkpoints.steps() if step > restored.step]
    checkpoints.close()
    moved = {}
    if newer and jax.process_index() == 0:
        moved = set_aside(checkpoints.directory, newer, workdir / SET_ASIDE_DIR)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("train: newer checkpoints set aside")
    damaged = {e.step: e for e in restored.skipped}
    for step, dest in moved.items():
        why = damaged.get(step, f"checkpoint step {step} is after --resume-from {restored.step}")
        say(f"{why}; moved to {dest}, not deleted (rm -r {dest} removes it)")


class _Run:
    """The mutable parts of one call of `train`."""

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, mesh, data: np.ndarray):
        self.cfg = train_cfg
        self.trainer = get_trainer(model_cfg, train_cfg, mesh)
        self.pid, self.nproc = jax.process_index(), jax.process_count()
        self.train_data, self.eval_data = data_lib.split(
            data, train_cfg.eval_fraction, seq_len=train_cfg.seq_len
        )
        local = dict(process_index=self.pid, process_count=self.nproc)
        self.eval_set = (
            [
                (self.trainer.place_batch(x), self.trainer.place_batch(y))
                for x, y in data_lib.eval_batches(
                    self.eval_data,
                    batch_size=train_cfg.batch_size,
                    seq_len=train_cfg.seq_len,
                    num_batches=train_cfg.eval_batches,
                    **local,
                )
            ]
            if train_cfg.eval_every
            else []
        )
        self.local = local
        self.tokens_per_step = train_cfg.batch_size * train_cfg.seq_len
        flops = model_flops_per_token(self.trainer.model_cfg, train_cfg.seq_len)
        peak = peak_flops(jax.devices()[0])
        num_devices = 1 if mesh is None else mesh.size
        self.peak_total = None if peak is None else peak * num_devices
        self.flops_per_token = flops

    def batch(self, step: int) -> tuple[jax.Array, jax.Array]:
        x, y = data_lib.batch_at(
            self.train_data,
            step,
            batch_size=self.cfg.batch_size,
            seq_len=self.cfg.seq_len,
            seed=self.cfg.seed,
            **self.local,
        )
        return self.trainer.place_batch(x), self.trainer.place_batch(y)

    def evaluate(self, state: TrainState) -> float:
        losses = [self.trainer.eval_loss(state, x, y) for x, y in self.eval_set]
        return float(np.mean(jax.device_get(losses)))

    def mfu(self, tokens_per_s: float | None) -> float | None:
        """The model FLOPs of `tokens_per_s` over the devices' peak (None where unknown)."""
        if self.peak_total is None or tokens_per_s is None:
            return None
        return self.flops_per_token * tokens_per_s / self.peak_total

    def record(self, step: int, metrics: dict[str, Any], seconds: float, time_s: float) -> dict:
        shares, max_over_mean = _expert_load(np.asarray(metrics["tokens_per_expert"]))
        tokens_per_s = self.tokens_per_step / seconds
        mfu = self.mfu(tokens_per_s)
        return {
            "step": step,
            "loss": float(metrics["loss"]),
            "total_loss": float(metrics["total_loss"]),
            "lr": float(metrics["lr"]),
            "grad_norm": float(metrics["grad_norm"]),
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "expert_load": shares,
            "load_max_over_mean": max_over_mean,
            "dropped": int(metrics["dropped"]),
            "rounds": [int(r) for r in np.asarray(metrics["rounds"])],
            "time_s": time_s,
        }


def _mesh(train_cfg: TrainConfig, model_cfg: ModelConfig):
    """The run's mesh; None (one device, no mesh) for a one-device run of an implementation
    other than "xla" ("auto" as resolved): "reference" runs only without a mesh, and "pallas"
    and "fused" have a faster path on one device than on a 1-device mesh."""
    mesh = make_train_mesh(train_cfg)
    moe_cfg = dataclasses.replace(model_cfg.moe, implementation=train_cfg.implementation)
    implementation, _ = mok_jax.resolve_implementation(moe_cfg)
    if mesh.size == 1 and implementation != "xla" and jax.process_count() == 1:
        return None
    return mesh


StateHook = Callable[[int, TrainState], TrainState]


def train(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    *,
    resume: bool = False,
    resume_from: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    sample: bool = True,
    state_hook: StateHook | None = None,
    log: Callable[[str], None] = print,
) -> Summary:
    """Trains the model of `model_cfg` as `train_cfg` says, in `train_cfg.workdir`.

    Args:
      model_cfg: the model.
      train_cfg: the run (steps, schedule, batch, data, mesh, workdir, ...).
      resume: continue from the newest checkpoint in the workdir that passes verification
        (a fresh start when there is none); damaged newer steps are reported, one line each,
        and moved to workdir/checkpoints_set_aside (the run writes those steps again).
      resume_from: continue from this step's checkpoint (implies `resume`); the steps after
        it are moved aside as above.
      overwrite: delete a previous run's checkpoints and logs in the workdir first.
      progress: show the progress bar (process 0).
      sample: at the end, sample a few lines from the model into workdir/samples.txt.
      state_hook: called as `state = state_hook(step, state)` before each step (0-based step
        about to run); for tests (e.g. injecting a NaN).
      log: where the run's messages go (process 0 only).

    Returns:
      A `Summary`.

    Raises:
      TrainingDiverged: the loss or gradient norm was NaN or Inf at some step; nothing is saved
        from that step on, so the latest checkpoint is the last good one.
      WorkdirInUse: a fresh run over another run's checkpoints (without resume or overwrite).
      data.DataError, ValueError: bad data, configs that do not fit the mesh, a workdir that
        is a file, a resumed run whose checkpoint is past `train_cfg.steps`, of another
        model, or with no checkpoint that passes verification. Nothing is written to disk
        before these checks pass.
    """
    started = time.perf_counter()
    workdir = pathlib.Path(train_cfg.workdir)
    say = log if jax.process_index() == 0 else (lambda _: None)
    data = data_lib.load_bytes(train_cfg.data)  # first: a bad path fails before any work
    resume = resume or resume_from is not None
    _check_workdir(workdir, resume=resume, overwrite=overwrite)
    mesh = _mesh(train_cfg, model_cfg)
    run = _Run(model_cfg, train_cfg, mesh, data)
    trainer = run.trainer
    restored = None
    if resume and not overwrite:
        restored = _resume_point(workdir, trainer, train_cfg, resume_from, say)
    _prepare_workdir(workdir, overwrite=overwrite)  # the run is accepted: now it writes
    if restored is not None:
        _set_aside_newer(workdir, restored, say)
        say(_resumed_line(restored, workdir))
        state = restored.state
    else:
        state = trainer.init_state()
    checkpoints = Checkpoints(workdir)
    start = int(jax.device_get(state.step))
    if run.pid == 0:
        # What "auto" resolved to, with the reasons, beside the config that says "auto".
        choices = trainer.moe_resolution.choices().items()
        resolved = {name: {"value": v, "why": why} for name, (v, why) in choices}
        extra = {"train": dataclasses.asdict(train_cfg), "moe_resolved": resolved}
        write_config(workdir, trainer.model_cfg, extra)
    say(
        f"{'no mesh' if mesh is None else f'mesh {dict(mesh.shape)}'} on "
        f"{1 if mesh is None else mesh.size} {jax.devices()[0].platform} device(s) "
        f"({run.nproc} process{'es' if run.nproc > 1 else ''}); steps {start} -> "
        f"{train_cfg.steps}; batch {train_cfg.batch_size} x {train_cfg.seq_len} tokens; "
        f"data {train_cfg.data!r} ({run.train_data.size:,} train / {run.eval_data.size:,} eval "
        f"bytes); workdir {workdir}"
    )
    say(_plan_line(trainer))
    if start < train_cfg.steps and not trainer.compiled:
        say(_compile_line(trainer.compile()))
    logger = RunLogger(
        workdir,
        total_steps=train_cfg.steps,
        start_step=start,
        enabled=run.pid == 0,
        progress=progress,
    )
    saved = None if restored is None else restored.step
    steps = _Steps(run, checkpoints, logger, started, saved=saved)
    try:
        state = steps.run(state, start, train_cfg.steps, state_hook)
        if int(jax.device_get(state.step)) != steps.saved:
            checkpoints.save(state)
    finally:
        logger.close()
        checkpoints.close()
    samples = _finish(run, state, workdir, say, sample=sample)
    return Summary(
        start_step=start,
        steps=int(jax.device_get(state.step)),
        final_loss=steps.losses[-1] if steps.losses else None,
        final_eval_loss=steps.eval_loss,
        tokens_per_s=steps.tokens_per_s,
        mfu=run.mfu(steps.tokens_per_s),
        peak_memory_bytes=_peak_memory(),
        time_s=time.perf_counter() - started,
        losses=steps.losses,
        workdir=workdir,
        samples=samples,
    )


def _resumed_line(restored: Restored, workdir: pathlib.Path) -> str:
    """Where the run resumes, and how many steps it redoes when it passed newer ones over."""
    line = f"resumed from {workdir / 'checkpoints'} at step {restored.step}"
    redo = restored.newest - restored.step
    if restored.skipped:
        line += ", the newest good checkpoint"
    if redo == 1:
        line += f": step {restored.newest} is redone (1 step)"
    elif redo > 1:
        line += f": steps {restored.step + 1}-{restored.newest} are redone ({redo} steps)"
    if not restored.checked:
        line += " (saved without checksums: its values are not checked)"
    return line


class _Steps:
    """The loop over steps. Step n + 1 is dispatched before step n's metrics are read, so the
    host prepares the next batch and reads the last metrics while the device computes; the
    loop waits for the device only where a step's state is needed (evaluation and checkpoint
    steps, the last step). A step whose loss or gradient norm is not finite raises
    `TrainingDiverged` when its metrics are read: it and every later step are neither logged
    nor saved (a checkpoint is written only after its step's metrics were checked)."""

    def __init__(self, run: _Run, checkpoints: Checkpoints, logger: RunLogger, started, saved):
        self.run_, self.checkpoints, self.logger, self.started = run, checkpoints, logger, started
        self.saved = saved
        self.losses: list[float] = []
        self.eval_loss: float | None = None
        self._steady_tokens, self._steady_seconds = 0, 0.0
        self._last_read: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """Mean throughput over the steps after the first."""
        return self._steady_tokens / self._steady_seconds if self._steady_seconds else None

    def run(self, state: TrainState, start: int, stop: int, state_hook) -> TrainState:
        """Steps start..stop-1 from `state`; returns the final state."""
        cfg, trainer = self.run_.cfg, self.run_.trainer
        pending = None  # (done, metrics) of the step dispatched last, not yet read
        self._last_read = time.perf_counter()
        for step in range(start, stop):
            if state_hook is not None:
                state = state_hook(step, state)
            inputs, targets = self.run_.batch(step)
            state, metrics = trainer.train_step(state, inputs, targets)
            if pending is not None:
                self._finish(*pending, first=pending[0] == start + 1)
            done = step + 1
            pending = (done, metrics)
            needs_state = done == stop or (cfg.save_every and done % cfg.save_every == 0)
            needs_state = needs_state or (self.run_.eval_set and done % cfg.eval_every == 0)
            if needs_state:
                self._finish(done, metrics, first=done == start + 1, state=state, stop=stop)
                pending = None
        if pending is not None:
            self._finish(*pending, first=pending[0] == start + 1)
        return state

    def _finish(self, done, metrics, *, first, state=None, stop=None) -> None:
        """Reads step `done`'s metrics (waiting for the device), checks them, logs them, and
        with `state` (the state after the step) evaluates and saves where due."""
        cfg, run = self.run_.cfg, self.run_
        metrics = jax.device_get(metrics)
        now = time.perf_counter()
        seconds, self._last_read = now - self._last_read, now
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        if not (
            math.isfinite(loss)
            and math.isfinite(float(metrics["total_loss"]))
            and math.isfinite(grad_norm)
        ):
            raise TrainingDiverged(done, loss, grad_norm, self.checkpoints.latest_step())
        if not first:
            self._steady_tokens += run.tokens_per_step
            self._steady_seconds += seconds
        self.losses.append(loss)
        record = run.record(done, metrics, seconds, now - self.started)
        if state is not None and run.eval_set and (done % cfg.eval_every == 0 or done == stop):
            self.eval_loss = run.evaluate(state)
            record["eval_loss"] = self.eval_loss
        self.logger.log(record)
        if state is not None and cfg.save_every and done % cfg.save_every == 0:
            self.saved = self.checkpoints.save(state)


def _peak_memory() -> int | None:
    """The most memory the first local device held so far (None where it does not say)."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def _plan_line(trainer) -> str:
    """The MoE implementation, the remat policy and the memory estimate of the step."""
    cfg = trainer.train_cfg
    remat = f"{trainer.remat!r}{' (auto)' if cfg.remat == 'auto' else ''}"
    accum = f", {cfg.grad_accum} microbatches a step" if cfg.grad_accum > 1 else ""
    estimate = trainer.memory_estimate().report(trainer.device_bytes)
    moe = trainer.moe_resolution
    why = moe.reasons["implementation"]
    return f"{moe.summary()} [{why}], remat {remat}{accum}; {estimate}"


def _compile_line(times) -> str:
    """How long the train step took to get ready, by stage."""
    if times.lowered == "read":
        lowered = f"lowered step read from the cache in {times.lower_s:.1f} s"
    elif times.trace_s is None:
        lowered = f"traced and lowered in {times.lower_s:.1f} s, kept in the cache"
    else:
        lowered = (
            f"traced in {times.trace_s:.1f} s, lowered in {times.lower_s:.1f} s "
            f"({times.lowered.removeprefix('traced ').strip('()')})"
        )
    return (
        f"train step ready in {times.total_s:.1f} s: {lowered}, compiled in {times.compile_s:.1f} s"
    )


def _finish(run: _Run, state: TrainState, workdir: pathlib.Path, say, *, sample: bool):
    """The plot and the samples (process 0 writes them)."""
    metrics_path = workdir / "metrics.jsonl"
    if run.pid == 0 and metrics_path.is_file() and metrics_path.stat().st_size:
        png = plot_run(metrics_path, workdir / PLOT_FILE)
        say(f"plot: {png}")
    if not sample:
        return None
    prompts = _prompts(run.eval_data)
    model = run.trainer.model(state)
    continuations = generate(
        model, prompts, max_new_bytes=SAMPLE_BYTES, temperature=SAMPLE_TEMPERATURE
    )
    if run.pid != 0:
        return None
    text = format_samples(prompts, continuations, SAMPLE_TEMPERATURE)
    (workdir / SAMPLES_FILE).write_text(text, encoding="utf-8")
    say(f"samples ({workdir / SAMPLES_FILE}):\n{text}")
    return text


def _prompts(eval_data: np.ndarray) -> list[bytes]:
    """A few distinct prompts from the held-out text: at evenly spaced lines, the first line
    that is neither blank nor already taken (its first 40 bytes)."""
    lines = [line[:40] for line in bytes(eval_data).split(b"\n")]
    prompts: list[bytes] = []
    for i in range(SAMPLE_PROMPTS):
        for line in lines[i * len(lines) // SAMPLE_PROMPTS :]:
            if line.strip() and line not in prompts:
                prompts.append(line)
                break
    return prompts or [bytes(eval_data[:16])]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeterminismReport:
    """Two runs of the same steps from fresh states: are they bitwise equal?"""

    steps: int
    losses_equal: bool
    params_equal: bool
    first_difference: int | None  # the first step whose losses differ
    losses: tuple[list[float], list[float]]

    @property
    def equal(self) -> bool:
        return self.losses_equal and self.params_equal


def check_determinism(model_cfg: ModelConfig, train_cfg: TrainConfig) -> DeterminismReport:
    """Runs `train_cfg.steps` steps twice, each from a fresh state (no checkpoints, no logs),
    and compares the losses and the final parameters bit for bit."""
    mesh = _mesh(train_cfg, model_cfg)
    run = _Run(model_cfg, train_cfg, mesh, data_lib.load_bytes(train_cfg.data))
    # One run at a time: the first run's state is freed before the second is built (two
    # states and a step's workspace need not fit the device together).
    (losses_a, params_a), (losses_b, params_b) = (_losses_and_params(run, train_cfg) for _ in "ab")
    differ = [
        i
        for i, (a, b) in enumerate(zip(losses_a, losses_b, strict=True))
        if a.tobytes() != b.tobytes()
    ]
    params_equal = all(
        np.asarray(a).tobytes() == np.asarray(b).tobytes()
        for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True)
    )
    return DeterminismReport(
        steps=train_cfg.steps,
        losses_equal=not differ,
        params_equal=params_equal,
        first_difference=differ[0] + 1 if differ else None,
        losses=([float(x) for x in losses_a], [float(x) for x in losses_b]),
    )


def _losses_and_params(run: _Run, train_cfg: TrainConfig) -> tuple[list[np.ndarray], Any]:
    """`train_cfg.steps` steps from a fresh state: the losses and the final parameters, on
    the host; nothing of the run stays on the device."""
    state = run.trainer.init_state()
    losses = []
    for step in range(train_cfg.steps):
        state, metrics = run.trainer.train_step(state, *run.batch(step))
        losses.append(metrics["loss"])
    return [np.asarray(loss) for loss in jax.device_get(losses)], host_params(state.params)


def summary_json(summary: Summary) -> str:
    """The summary as one JSON line (without the per-step losses and samples)."""
    keys = (
        "start_step",
        "steps",
        "final_loss",
        "final_eval_loss",
        "tokens_per_s",
        "mfu",
        "peak_memory_bytes",
        "time_s",
    )
    return json.dumps({k: getattr(summary, k) for k in keys} | {"workdir": str(summary.workdir)})
