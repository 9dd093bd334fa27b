"""The training run's log: JSON lines, TensorBoard event files (tensorboardX) and a progress bar.

One record per logged step, a flat dict with at least `step` (int) and `loss` (float). The loop
writes these keys (the plots read them):

  step, loss, total_loss, lr, grad_norm, tokens_per_s, time_s   scalars
  mfu                    float or None (no FLOP estimate for the device)
  expert_load            [L][E] floats: each expert's share of the routed rows, per MoE layer
  load_max_over_mean     [L] floats: max over mean of the expert load, per MoE layer
  dropped                int, rows dropped by a capacity factor
  rounds                 [L] ints: exchange rounds per MoE layer (1 when the buffers held all)
  eval_loss              on evaluation steps only

Outputs under the run's folder:
  metrics.jsonl   one JSON object per line, flushed at every record; NaN and Inf are written as
                  null and their keys listed in the record's `nonfinite` field (JSON has no NaN).
  tensorboard/    event files, when tensorboardX is installed: each scalar as a scalar; a list
                  of scalars as one scalar per index (`load_max_over_mean/0`); a list of lists
                  (`expert_load`) as one histogram per outer index (`expert_load/0`: the
                  distribution of the experts' shares).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import pathlib
import sys
import time
import types
import typing
import warnings

import numpy as np
from tqdm import tqdm

try:  # Optional: without tensorboardX the run writes no event files (one warning says so).
    from tensorboardX import SummaryWriter
except ImportError:
    SummaryWriter = None

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

# Seconds between TensorBoard flushes (tensorboardX's default is 120; the JSON lines are the
# crash-safe record, this only bounds how stale a live TensorBoard view is).
_TB_FLUSH_SECS = 10

Record = dict[str, typing.Any]


def _jsonable(value: typing.Any, key: str, nonfinite: list[str]) -> typing.Any:
    """`value` as plain JSON data; NaN/Inf become None and their key paths go to `nonfinite`."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        if math.isfinite(value):
            return value
        nonfinite.append(key)
        return None
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{key}/{i}", nonfinite) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, f"{key}/{k}", nonfinite) for k, v in value.items()}
    if hasattr(value, "__array__"):  # numpy and jax arrays, numpy scalars of other kinds
        array = np.asarray(value)
        if array.dtype.kind not in "biuUS":  # floats, bfloat16 (kind "V") included
            array = array.astype(np.float64)
        return _jsonable(array.tolist(), key, nonfinite)
    raise TypeError(f"metric {key!r} has a value of type {type(value).__name__}: {value!r}")


def _is_scalar(value: typing.Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse_lines(text: str, path: pathlib.Path) -> list[Record]:
    """The records of a metrics file's text. A last line without its newline is the trace of a
    crash during a write and is dropped; any other line that is not a JSON object is an error."""
    # After the final newline split() leaves "" (or the partial line of a crash): not parsed.
    complete = text.split("\n")[:-1]
    records = []
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(path)!r} line {number} is not valid JSON: {e}") from e
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"{str(path)!r} line {number} is not a record with an int step")
        records.append(record)
    return records


def read_metrics(path: str | os.PathLike[str]) -> list[Record]:
    """The records of a metrics.jsonl file, in file order.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a line (other than a partial last line) is not a JSON record with an int step.
    """
    path = pathlib.Path(path)
    return _parse_lines(path.read_text(encoding="utf-8"), path)


def _atomic_write(path: pathlib.Path, text: str) -> None:
    """Writes `text` to `path` through a temporary file in the same folder and a rename, so the
    file is either the old or the new one, never a mix. (Not `tempfile.mkstemp`: its 0600 mode
    would stay on the renamed file; "x" mode gets the usual permissions and a fresh file.)"""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.time_ns()}.tmp")
    try:
        with tmp.open("x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class RunLogger:
    """Logs a training run's records to metrics.jsonl, TensorBoard and a progress bar.

    Args:
      workdir: the run's folder (created if missing).
      total_steps: the run's last step, the progress bar's total.
      start_step: the step the run starts from. 0 starts a fresh metrics.jsonl (an old one is
        replaced). A resumed run (> 0) keeps the records with step <= start_step and drops the
        later ones, which it will write again; TensorBoard hides the old events from
        start_step + 1 on (tensorboardX's `purge_step`).
      enabled: False (processes other than 0) writes and shows nothing.
      progress: show the tqdm bar on stderr.

    Example:
      >>> with RunLogger(workdir, total_steps=100, progress=False) as log:
      ...     log.log({"step": 1, "loss": 5.5, "tokens_per_s": 1.2e4})
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        progress: bool = True,
    ):
        for name, value in (("total_steps", total_steps), ("start_step", start_step)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        self.workdir = pathlib.Path(workdir)
        self.metrics_path = self.workdir / METRICS_FILE
        self.total_steps = int(total_steps)
        self.start_step = int(start_step)
        self.enabled = bool(enabled)
        self._closed = False
        self._file = None
        self._writer = None
        self._bar = None
        self._last_eval: float | None = None
        self._last_tokens_per_s: float | None = None
        if not self.enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.start_step > 0 and self.metrics_path.exists():
            kept = [r for r in read_metrics(self.metrics_path) if r["step"] <= self.start_step]
        _atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = self.metrics_path.open("a", encoding="utf-8")

        self._writer = self._tensorboard_writer()
        if progress:
            self._bar = tqdm(
                total=self.total_steps,
                initial=self.start_step,
                file=sys.stderr,
                unit="step",
                dynamic_ncols=True,
            )

    def log(self, record: Record) -> None:
        """Writes one record: a JSON line (flushed), TensorBoard values, the bar's postfix.

        `record` needs `step` (int >= 0) and `loss` (a number or None); values are numbers,
        None, strings, lists/tuples of them, or numpy/jax arrays (written as lists).
        """
        if self._closed:
            raise RuntimeError("RunLogger.log after close()")
        if "step" not in record or "loss" not in record:
            raise ValueError(f"a record needs 'step' and 'loss', got keys {sorted(record)}")
        if "nonfinite" in record:
            raise ValueError("'nonfinite' is reserved: RunLogger fills it")
        nonfinite: list[str] = []
        clean = {str(k): _jsonable(v, str(k), nonfinite) for k, v in record.items()}
        step = clean["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={record['step']!r} must be an int >= 0")
        if nonfinite:
            clean["nonfinite"] = nonfinite
        if not self.enabled:
            return
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()
        self._write_tensorboard(clean, step)
        self._update_bar(clean, step)

    def _tensorboard_writer(self):
        """The event-file writer, or None (with a warning) when tensorboardX is missing."""
        if SummaryWriter is None:
            warnings.warn(
                "tensorboardX is not installed: no TensorBoard event files "
                f"(metrics still go to {self.metrics_path}); pip install tensorboardX for them",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        # Event file names hold the time in seconds and the host; the suffix keeps a quickly
        # resumed run from overwriting the previous run's file.
        return SummaryWriter(
            str(self.workdir / TENSORBOARD_DIR),
            purge_step=self.start_step + 1 if self.start_step > 0 else 0,
            flush_secs=_TB_FLUSH_SECS,
            filename_suffix=f".{os.getpid()}.{time.time_ns()}",
        )

    def _write_tensorboard(self, record: Record, step: int) -> None:
        if self._writer is None:
            return
        for key, value in record.items():
            if key == "step":
                continue
            if _is_scalar(value):
                self._writer.add_scalar(key, value, step)
            elif isinstance(value, list) and all(_is_scalar(v) or v is None for v in value):
                for i, v in enumerate(value):
                    if v is not None:
                        self._writer.add_scalar(f"{key}/{i}", v, step)
            elif isinstance(value, list) and all(isinstance(v, list) for v in value):
                for i, row in enumerate(value):
                    finite = [v for v in row if _is_scalar(v)]
                    if finite:
                        self._writer.add_histogram(
                            f"{key}/{i}", np.asarray(finite, np.float64), step, bins="auto"
                        )

    def _update_bar(self, record: Record, step: int) -> None:
        if self._bar is None:
            return
        if record.get("eval_loss") is not None:
            self._last_eval = record["eval_loss"]
        if record.get("tokens_per_s") is not None:
            self._last_tokens_per_s = record["tokens_per_s"]
        parts = [f"loss={_fmt(record['loss'])}"]
        if self._last_eval is not None:
            parts.append(f"eval={_fmt(self._last_eval)}")
        if self._last_tokens_per_s is not None:
            parts.append(f"tok/s={self._last_tokens_per_s:,.0f}")
        self._bar.set_postfix_str(" ".join(parts), refresh=False)
        self._bar.update(max(step - self._bar.n, 0))

    def close(self) -> None:
        """Flushes and closes the files and the bar. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        self.close()


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
