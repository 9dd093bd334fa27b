"""The training run's picture: loss curves and the expert load over steps, as one PNG.

Drawn with `matplotlib.figure.Figure` and the Agg canvas directly, never through pyplot: no global
backend switch, no figure registry, nothing changed for other users of matplotlib in the process.

Panels, top to bottom (all against the step):
  loss          train loss (line) and eval loss (dots), on a log scale when the loss spans
                more than a factor of 10
  max/mean      each MoE layer's expert load max over mean (1 is perfect balance); every layer
  heatmaps      the share of routed rows each expert received, one panel per MoE layer, at most
                `max_layer_panels` (evenly spaced layers, first and last included)
and a caption line with the final step's loss, eval loss and throughput.

Why per-layer heatmaps rather than the mean over layers: each layer routes on its own, so one
layer's hot expert and another's cold expert with the same index cancel in a mean and hide the
imbalance the plot exists to show. Four panels keep a figure readable; the max/mean panel above
still shows every layer, so a bad layer outside the panels is visible there.
"""

from __future__ import annotations

import math
import os
import pathlib

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from train.metrics import Record, read_metrics

_PANEL_HEIGHT = 2.4  # inches
_WIDTH = 10.0  # inches
_DPI = 100
# The most heatmap columns; longer runs average groups of consecutive steps.
_MAX_COLUMNS = 1000


def _float(value: object) -> float:
    """A record value as a float; None (also a non-finite value in the file) is NaN."""
    return math.nan if value is None else float(value)


def _merge_steps(records: list[Record]) -> list[Record]:
    """One record per step, sorted by step; records of the same step are merged, later values
    winning (an evaluation logged as its own record joins its step's training record)."""
    by_step: dict[int, Record] = {}
    for r in records:
        by_step.setdefault(r["step"], {}).update(r)
    return [by_step[s] for s in sorted(by_step)]


def _edges(steps: np.ndarray) -> np.ndarray:
    """Cell edges around each step: midpoints between neighbours, half a gap past the ends."""
    if steps.shape[0] == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    mid = (steps[1:] + steps[:-1]) / 2
    return np.concatenate([[2 * steps[0] - mid[0]], mid, [2 * steps[-1] - mid[-1]]])


def _bin_columns(
    edges: np.ndarray, values: np.ndarray, max_columns: int
) -> tuple[np.ndarray, np.ndarray]:
    """At most `max_columns` columns: groups of g = ceil(S / max_columns) consecutive steps,
    each the mean of its finite values (NaN if none). edges [S + 1], values [..., S]."""
    num_steps = values.shape[-1]
    group = -(-num_steps // max_columns)
    if group == 1:
        return edges, values
    pad = -num_steps % group
    padded = np.concatenate([values, np.full((*values.shape[:-1], pad), np.nan)], axis=-1)
    padded = padded.reshape(*values.shape[:-1], -1, group)
    finite = np.isfinite(padded)
    count = finite.sum(axis=-1)
    total = np.where(finite, padded, 0.0).sum(axis=-1)
    mean = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return np.append(edges[:-1:group], edges[-1]), mean


def _expert_load(records: list[Record]) -> np.ndarray | None:
    """Expert shares [L, E, S] over the S records (NaN where a record has none), or None."""
    loads = [r.get("expert_load") or [] for r in records]
    num_layers = max((len(load) for load in loads), default=0)
    num_experts = max((len(row) for load in loads for row in load if row), default=0)
    if num_layers == 0 or num_experts == 0:
        return None
    out = np.full((num_layers, num_experts, len(records)), np.nan)
    for s, load in enumerate(loads):
        for l, row in enumerate(load):
            for e, share in enumerate(row or []):
                out[l, e, s] = _float(share)
    return out


def _max_over_mean(records: list[Record], load_les: np.ndarray | None) -> np.ndarray | None:
    """Max over mean of the expert load [L, S]: the records' `load_max_over_mean`, or else
    computed from `expert_load`; None when neither is there."""
    rows = [r.get("load_max_over_mean") or [] for r in records]
    num_layers = max((len(row) for row in rows), default=0)
    if num_layers:
        out = np.full((num_layers, len(records)), np.nan)
        for s, row in enumerate(rows):
            for l, value in enumerate(row):
                out[l, s] = _float(value)
        return out
    if load_les is None:
        return None
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.max(load_les, axis=1) / np.mean(load_les, axis=1)


def _caption(records: list[Record]) -> str:
    last = records[-1]
    parts = [f"final step {last['step']}"]
    loss = _float(last.get("loss"))
    parts.append(f"loss {loss:.4f}" if math.isfinite(loss) else "loss non-finite")
    evals = [r for r in records if r.get("eval_loss") is not None]
    if evals:
        parts.append(f"eval loss {evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']})")
    if last.get("tokens_per_s") is not None:
        parts.append(f"{last['tokens_per_s']:,.0f} tokens/s")
    if last.get("dropped"):
        parts.append(f"{last['dropped']} rows dropped")
    return ", ".join(parts)


def _layer_panels(num_layers: int, limit: int) -> list[int]:
    if num_layers <= limit:
        return list(range(num_layers))
    return sorted({round(i * (num_layers - 1) / (limit - 1)) for i in range(limit)})


def plot_run(
    metrics_path: str | os.PathLike[str],
    png_path: str | os.PathLike[str],
    *,
    title: str | None = None,
    max_layer_panels: int = 4,
) -> pathlib.Path:
    """Draws a run's metrics.jsonl as one PNG (see the module docstring for the panels).

    Works for one step, without eval records, and without expert load (a dense model: the loss
    panel only).

    Args:
      metrics_path: a metrics.jsonl written by `train.metrics.RunLogger`.
      png_path: the PNG to write (its folder is created).
      title: the figure's title; default "training run: <the metrics file's folder name>".
      max_layer_panels: the most heatmap panels (>= 2; evenly spaced layers when there are more).

    Returns:
      The PNG's path.

    Raises:
      ValueError: the metrics file is missing, empty, or malformed.
    """
    if isinstance(max_layer_panels, bool) or not isinstance(max_layer_panels, int):
        raise ValueError(f"{max_layer_panels=} must be an int")
    if max_layer_panels < 2:
        raise ValueError(f"{max_layer_panels=} must be >= 2")
    metrics_path = pathlib.Path(metrics_path)
    png_path = pathlib.Path(png_path)
    try:
        records = read_metrics(metrics_path)
    except FileNotFoundError as e:
        raise ValueError(f"metrics file {str(metrics_path)!r} does not exist") from e
    if not records:
        raise ValueError(f"metrics file {str(metrics_path)!r} has no records")
    records = _merge_steps(records)
    steps = np.array([r["step"] for r in records], dtype=np.float64)
    loss = np.array([_float(r.get("loss")) for r in records])
    evals = [r for r in records if r.get("eval_loss") is not None]
    load_les = _expert_load(records)
    ratio_ls = _max_over_mean(records, load_les)
    layers = [] if load_les is None else _layer_panels(load_les.shape[0], max_layer_panels)

    num_panels = 1 + (ratio_ls is not None) + len(layers)
    fig = Figure(figsize=(_WIDTH, _PANEL_HEIGHT * num_panels + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(num_panels, 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(title if title is not None else f"training run: {metrics_path.parent.name}")

    # (a) Loss curves.
    ax = axes[0]
    single = len(steps) < 3  # markers, or one or two points would not show
    ax.plot(
        steps, loss, color="C0", linewidth=1.2, marker="." if single else None, label="train loss"
    )
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_loss"] for r in evals],
            color="C1",
            marker="o",
            markersize=4,
            label="eval loss",
        )
    finite = np.concatenate([loss, [r["eval_loss"] for r in evals]])
    finite = finite[np.isfinite(finite)]
    if finite.size and finite.min() > 0 and finite.max() > 10 * finite.min():
        ax.set_yscale("log")
    ax.set_ylabel("loss (nats/byte)")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)

    # (b) Load balance: max/mean per layer, then the per-layer heatmaps.
    panel = 1
    if ratio_ls is not None:
        ax = axes[panel]
        for l, ratio in enumerate(ratio_ls):
            label = f"layer {l}" if len(ratio_ls) <= 8 else None
            ax.plot(steps, ratio, linewidth=1.0, marker="." if single else None, label=label)
        ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
        ax.set_ylabel("load max / mean")
        if len(ratio_ls) <= 8:
            ax.legend(loc="upper right", ncols=min(len(ratio_ls), 4), fontsize="small")
        ax.grid(alpha=0.3)
        panel += 1
    if layers:
        assert load_les is not None
        shown = np.ma.masked_invalid(load_les[layers])
        vmax = float(shown.max()) if shown.count() else 1.0
        # Long runs: at most _MAX_COLUMNS columns (the PNG is 1000 pixels wide anyway).
        edges_x, binned_les = _bin_columns(_edges(steps), load_les, _MAX_COLUMNS)
        edges_y = np.arange(load_les.shape[1] + 1) - 0.5
        mesh = None
        for l, ax in zip(layers, axes[panel:], strict=True):
            mesh = ax.pcolormesh(
                edges_x, edges_y, np.ma.masked_invalid(binned_les[l]), vmin=0.0, vmax=vmax
            )
            ax.set_ylabel(f"layer {l}\nexpert")
        fig.colorbar(mesh, ax=axes[panel:], label="share of routed rows", shrink=0.9)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))

    # (c) Caption.
    fig.supxlabel(_caption(records), fontsize="medium")
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=_DPI)
    return png_path
