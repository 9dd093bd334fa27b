"""The benchmark plots of bench/results/README.md, redrawn from the committed result files.

    .venv/bin/python scripts/plot_results.py [--results bench/results] [--out bench/results/plots]

Each figure reads only files under `--results` and writes one PNG into `--out`:
  moe_layer_h200.png      the MoE layer's forward+backward on one H200: the paired speedup of
                          `fused` over each peer (peer ms / fused ms, timed in alternation),
                          with the defaults and with the speed options (moe_layer_h200.json)
  grouped_gemm_h200.png   the grouped GEMMs on one H200: TFLOP/s of ours, torch._grouped_mm and
                          the other baselines at each shape, per product (grouped_gemm_h200.json)
  training_h100.png       the `gpu` preset's train step on one H100: loss and tokens/s a step of
                          the committed runs (*/train*_metrics.jsonl)
  scaling_h200x2.png      weak scaling on two H200s (multi_gpu_h200x2.json) and the rack model's
                          calibration against the measured single-H200 times (rack_model.json)

Where a result file holds several runs of the same point, the plot takes the last run in the
file that timed it. Drawn with `matplotlib.figure.Figure` on the Agg canvas, never through pyplot
(as train/plots.py), and saved without the matplotlib version in the PNG, so a rerun on the same
files gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections.abc import Callable, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter, NullFormatter

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
_DPI = 100
# Names of the PNGs, in the order they are drawn.
MOE_LAYER = "moe_layer_h200.png"
GROUPED_GEMM = "grouped_gemm_h200.png"
TRAINING = "training_h100.png"
SCALING = "scaling_h200x2.png"
# The training runs drawn, oldest first: (result folder, metrics file).
TRAINING_RUNS = (
    ("2026-12-06_train_step_h100", "train40_metrics.jsonl"),
    ("2026-12-07_train_step_cublas_h100", "train40_metrics.jsonl"),
    ("2026-12-07_train_gpu_preset_h100", "train300_metrics.jsonl"),
)
MOE_PEERS = ("pallas", "tokamax", "torch", "torch_det", "xla")
GEMM_FAMILIES = ("ours", "torch", "tokamax", "jax_example", "xla")
GEMM_PRODUCTS = ("forward", "dgrad", "wgrad", "backward", "swiglu")
# One colour per bar series, the same in every figure.
COLORS = {
    name: f"C{i}"
    for i, name in enumerate(
        ("ours", "torch", "tokamax", "jax_example", "xla", "torch_det", "pallas")
    )
}


def _save(fig: Figure, path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=_DPI, metadata={"Software": None})
    return path


def _bars(ax, groups: Sequence[str], series: dict[str, list[float]], fmt: str) -> None:
    """Grouped bars: one group per entry of `groups`, one bar per series (NaN: no bar), each
    labelled with its value in `fmt`."""
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(groups))
    for i, (name, values) in enumerate(series.items()):
        heights = np.array(values, dtype=float)
        shown = np.isfinite(heights)
        pos = x[shown] + (i - (len(series) - 1) / 2) * width
        bars = ax.bar(pos, heights[shown], width, label=name, color=COLORS.get(name))
        ax.bar_label(bars, [fmt.format(v) for v in heights[shown]], fontsize=6, padding=1)
    ax.set_xticks(x, groups, fontsize=8)


def moe_layer_speedups(data: dict) -> dict[str, dict[tuple[str, str], float]]:
    """{"defaults" | "options": {(shape, peer): paired speedup}} of the forward+backward, from
    moe_layer_h200.json's runs. "options" are runs with both speed options set (residuals
    gate_up and token chunk 2048); runs with one option alone are neither."""
    out: dict[str, dict[tuple[str, str], float]] = {"defaults": {}, "options": {}}
    for run in data["runs"].values():
        options = run["args"].get("fused_options") or {}
        if not options:
            config = "defaults"
        elif options.get("fused_residuals") == "gate_up" and options.get("token_chunk") == 2048:
            config = "options"
        else:
            continue
        for entry in run["shapes"]:
            record = entry["products"].get("fwd_bwd")
            for candidate in record["candidates"] if record else ():
                speedup = candidate.get("fused_speedup_paired")
                if candidate["key"] in MOE_PEERS and speedup is not None:
                    out[config][(entry["shape"]["name"], candidate["key"])] = speedup
    return out


def plot_moe_layer(results: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    data = json.loads((results / "moe_layer_h200.json").read_text())
    speedups = moe_layer_speedups(data)
    fig = Figure(figsize=(11, 7.5))
    for ax, config in zip(fig.subplots(2, 1), ("defaults", "options"), strict=True):
        points = speedups[config]
        shapes = list(dict.fromkeys(shape for shape, _ in points))
        peers = [p for p in MOE_PEERS if any(peer == p for _, peer in points)]
        series = {p: [points.get((s, p), math.nan) for s in shapes] for p in peers}
        _bars(ax, shapes, series, "{:.2f}x")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylim(0.8, max(points.values()) * 1.6)
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("peer ms / fused ms (paired)")
        ax.set_title(f"fused ({config}) over each peer, forward+backward, one H200", fontsize=10)
        ax.legend(fontsize=7, ncols=len(peers), loc="upper left")
    fig.suptitle(f"MoE layer, {data['date']}: above 1, fused is faster", fontsize=11)
    fig.tight_layout()
    return _save(fig, out / MOE_LAYER)


def gemm_tflops(data: dict) -> dict[str, dict[tuple[str, str], float]]:
    """{product: {(shape, family): TFLOP/s}} from grouped_gemm_h200.json: each family's first
    candidate that passed its check and was timed (ours: the Mosaic GPU kernel)."""
    out: dict[str, dict[tuple[str, str], float]] = {}
    for entry in data["shapes"]:
        for product, record in entry["products"].items():
            for candidate in record["candidates"]:
                key = (entry["shape"]["name"], candidate["family"])
                if candidate["status"] == "ok" and candidate.get("tflops") is not None:
                    out.setdefault(product, {}).setdefault(key, candidate["tflops"])
    return out


def plot_grouped_gemm(results: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    data = json.loads((results / "grouped_gemm_h200.json").read_text())
    tflops = gemm_tflops(data)
    products = [p for p in GEMM_PRODUCTS if p in tflops]
    fig = Figure(figsize=(11, 2.9 * len(products)))
    ceiling = data.get("ceilings", {}).get("torch_matmul_8192_tflops")
    for ax, product in zip(np.atleast_1d(fig.subplots(len(products), 1)), products, strict=True):
        points = tflops[product]
        shapes = list(dict.fromkeys(shape for shape, _ in points))
        families = [f for f in GEMM_FAMILIES if any(fam == f for _, fam in points)]
        series = {f: [points.get((s, f), math.nan) for s in shapes] for f in families}
        _bars(ax, shapes, series, "{:.0f}")
        if ceiling is not None:
            ax.axhline(ceiling, color="gray", linestyle="--", linewidth=0.8)
            label = f"dense 8192^3 matmul (torch) {ceiling:.0f}"
            ax.text(0.995, ceiling, label, transform=ax.get_yaxis_transform(), ha="right",
                    va="bottom", fontsize=7, color="gray")  # fmt: skip
        ax.set_ylim(0, (ceiling or 800) * 1.25)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(product, fontsize=10)
        ax.legend(fontsize=7, ncols=len(families), loc="upper left")
    env = data["environment"]
    fig.suptitle(f"Grouped GEMM, bf16, {env['device']}, {env['date_utc'][:10]}", fontsize=11)
    fig.tight_layout()
    return _save(fig, out / GROUPED_GEMM)


def read_jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_training(results: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    fig = Figure(figsize=(11, 4.2))
    loss_ax, speed_ax = fig.subplots(1, 2)
    for folder, name in TRAINING_RUNS:
        records = read_jsonl(results / folder / name)
        steps = [r["step"] for r in records]
        (line,) = loss_ax.plot(steps, [r["loss"] for r in records], linewidth=1, label=folder)
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        if evals:
            loss_ax.plot(*zip(*evals, strict=True), "o", color=line.get_color(), markersize=4)
        speed_ax.plot(steps, [r["tokens_per_s"] for r in records], linewidth=1, label=folder)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss (line: train, dots: eval)")
    loss_ax.set_yscale("log")
    speed_ax.set_xlabel("step")
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_yscale("log")
    speed_ax.legend(fontsize=7)
    fig.suptitle("The `gpu` preset's train step on one H100 (65,536 tokens a step)", fontsize=11)
    fig.tight_layout()
    return _save(fig, out / TRAINING)


def scaling_rows(data: dict) -> dict[tuple[str, int, str], dict]:
    """{(case, ep, exchange): row} of the `xla` layer's weak-scaling rows in
    multi_gpu_h200x2.json, the last timed row of each."""
    out = {}
    for run in data["calls"]:
        for row in run["result"]["rows"]:
            timed = row.get("fwd_bwd_ms") is not None
            if row["part"] == "scaling" and timed and row.get("implementation") in (None, "xla"):
                out[(row["case"], row["ep"], row["exchange"])] = row
    return out


def plot_scaling(results: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    rows = scaling_rows(json.loads((results / "multi_gpu_h200x2.json").read_text()))
    rack = json.loads((results / "2026-12-01_rack_model" / "rack_model.json").read_text())
    fig = Figure(figsize=(11, 4.5))
    scale_ax, model_ax = fig.subplots(1, 2, width_ratios=(1.6, 1))
    cases = list(dict.fromkeys(case for case, _, _ in rows))
    columns = list(dict.fromkeys((ep, exchange) for _, ep, exchange in rows))
    series = {
        f"EP {ep}, {exchange}": [rows.get((c, ep, exchange), {}).get("fwd_bwd_ms", math.nan)
                                 for c in cases]
        for ep, exchange in columns
    }  # fmt: skip
    _bars(scale_ax, cases, series, "{:.1f}")
    scale_ax.set_ylabel("forward+backward ms (tokens per device fixed)")
    scale_ax.set_title("`xla` layer, one H200 (EP 1) and two H200s (EP 2)", fontsize=10)
    scale_ax.legend(fontsize=7, loc="upper left")
    points = rack["calibration"]["points"]
    measured = [p["measured_ms"] for p in points]
    model_ax.scatter(measured, [p["model_ms"] for p in points], s=12)
    top = max(measured + [p["model_ms"] for p in points]) * 1.1
    model_ax.plot([0, top], [0, top], color="gray", linewidth=0.8)
    model_ax.set_xlabel("measured ms (fused, one H200)")
    model_ax.set_ylabel("rack model ms")
    rms = rack["calibration"]["rms_error"]
    model_ax.set_title(f"rack model calibration: {len(points)} points, RMS {rms:.1%}", fontsize=10)
    fig.suptitle("Expert parallelism: weak scaling measured, and the model behind the rack "
                 "predictions", fontsize=11)  # fmt: skip
    fig.tight_layout()
    return _save(fig, out / SCALING)


PLOTS: tuple[Callable[[pathlib.Path, pathlib.Path], pathlib.Path], ...] = (
    plot_moe_layer,
    plot_grouped_gemm,
    plot_training,
    plot_scaling,
)


def main(argv: Sequence[str] | None = None) -> list[pathlib.Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "plots")
    args = parser.parse_args(argv)
    written = [plot(args.results, args.out) for plot in PLOTS]
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main(sys.argv[1:])
