"""train/plots.py: the run's PNG for full, one-step, eval-less and dense runs; bad input."""

from __future__ import annotations

import json
import struct
import sys

import numpy as np
import pytest

from train import plots as P
from train.metrics import RunLogger

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) in pixels from the PNG's IHDR chunk, after checking the signature."""
    raw = path.read_bytes()
    assert raw[:8] == PNG_SIGNATURE and raw[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", raw[16:24])


def expected_size(num_panels: int) -> tuple[int, int]:
    return (
        round(P._WIDTH * P._DPI),
        round((P._PANEL_HEIGHT * num_panels + 0.8) * P._DPI),
    )


def write_run(folder, *, steps, layers=2, experts=4, eval_every=None, seed=0):
    rng = np.random.default_rng(seed)
    with RunLogger(folder, total_steps=max(steps), progress=False) as log:
        for step in steps:
            record = {"step": step, "loss": 5.0 / step, "tokens_per_s": 100.0}
            if layers:
                load = rng.dirichlet(np.ones(experts), size=layers)
                record["expert_load"] = load.tolist()
                record["load_max_over_mean"] = (load.max(1) / load.mean(1)).tolist()
            if eval_every and step % eval_every == 0:
                record["eval_loss"] = 5.5 / step
            log.log(record)
    return folder / "metrics.jsonl"


def test_full_run(tmp_path):
    was_loaded = "matplotlib.pyplot" in sys.modules
    metrics = write_run(tmp_path, steps=range(1, 31), layers=3, eval_every=10)
    png = P.plot_run(metrics, tmp_path / "out" / "run.png", title="test run")
    assert png == tmp_path / "out" / "run.png" and png.stat().st_size > 10_000
    # Loss, max/mean and one heatmap per layer (3).
    assert png_size(png) == expected_size(5)
    # No global matplotlib state touched: pyplot (which owns the backend choice and the figure
    # registry) is not imported. (matplotlib.get_backend() would import it itself.)
    assert ("matplotlib.pyplot" in sys.modules) == was_loaded


def test_expert_load_is_drawn(tmp_path):
    a = P.plot_run(write_run(tmp_path / "a", steps=range(1, 11), seed=0), tmp_path / "a.png")
    b = P.plot_run(write_run(tmp_path / "b", steps=range(1, 11), seed=1), tmp_path / "b.png")
    again = P.plot_run(tmp_path / "a" / "metrics.jsonl", tmp_path / "a2.png")
    assert a.read_bytes() == again.read_bytes()  # deterministic
    assert a.read_bytes() != b.read_bytes()  # only the expert load differs


def test_layer_panels_are_capped(tmp_path):
    assert P._layer_panels(3, 4) == [0, 1, 2]
    assert P._layer_panels(6, 4) == [0, 2, 3, 5]
    assert P._layer_panels(24, 4) == [0, 8, 15, 23]
    metrics = write_run(tmp_path, steps=range(1, 6), layers=6)
    assert png_size(P.plot_run(metrics, tmp_path / "run.png")) == expected_size(1 + 1 + 4)
    png = P.plot_run(metrics, tmp_path / "two.png", max_layer_panels=2)
    assert png_size(png) == expected_size(1 + 1 + 2)
    with pytest.raises(ValueError, match=r"max_layer_panels=1 must be >= 2"):
        P.plot_run(metrics, tmp_path / "x.png", max_layer_panels=1)


def test_one_step(tmp_path):
    metrics = write_run(tmp_path, steps=[1], eval_every=1)
    assert png_size(P.plot_run(metrics, tmp_path / "run.png")) == expected_size(4)


def test_dense_run_without_eval(tmp_path):
    metrics = write_run(tmp_path, steps=range(1, 8), layers=0)
    assert png_size(P.plot_run(metrics, tmp_path / "run.png")) == expected_size(1)


def test_max_over_mean_from_expert_load_and_nonfinite(tmp_path):
    lines = [
        {"step": 1, "loss": 4.0, "expert_load": [[0.75, 0.25]]},
        {"step": 2, "loss": None, "nonfinite": ["loss"], "expert_load": [[0.5, 0.5]]},
        {"step": 3, "loss": 3.0, "expert_load": None},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = P.read_metrics(path)
    load = P._expert_load(records)
    assert load.shape == (1, 2, 3) and np.isnan(load[0, :, 2]).all()
    np.testing.assert_allclose(P._max_over_mean(records, load)[0, :2], [1.5, 1.0])
    assert png_size(P.plot_run(path, tmp_path / "run.png")) == expected_size(3)


def test_caption():
    records = [
        {"step": 1, "loss": 4.0},
        {"step": 2, "loss": 3.5, "eval_loss": 3.75},
        {"step": 3, "loss": 3.25, "tokens_per_s": 12345.6, "dropped": 7},
    ]
    assert P._caption(records) == (
        "final step 3, loss 3.2500, eval loss 3.7500 (step 2), 12,346 tokens/s, 7 rows dropped"
    )
    assert P._caption([{"step": 5, "loss": None}]) == "final step 5, loss non-finite"


def test_missing_or_empty_metrics(tmp_path):
    with pytest.raises(ValueError, match=r"nowhere.jsonl' does not exist"):
        P.plot_run(tmp_path / "nowhere.jsonl", tmp_path / "run.png")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty.jsonl' has no records"):
        P.plot_run(tmp_path / "empty.jsonl", tmp_path / "run.png")
    assert not (tmp_path / "run.png").exists()


def test_long_runs_bin_heatmap_columns(tmp_path):
    edges = np.arange(6) + 0.5  # steps 1..5
    values = np.array([[1.0, 2.0, np.nan, 4.0, np.nan], [np.nan, np.nan, np.nan, 1.0, 3.0]])
    binned_edges, binned = P._bin_columns(edges, values, 2)  # groups of 3: steps 1-3, 4-5
    np.testing.assert_array_equal(binned_edges, [0.5, 3.5, 5.5])
    np.testing.assert_array_equal(binned, [[1.5, 4.0], [np.nan, 2.0]])
    same_edges, same = P._bin_columns(edges, values, 5)
    assert same_edges is edges and same is values
    metrics = write_run(tmp_path, steps=range(1, 2 * P._MAX_COLUMNS + 2), layers=1)
    assert png_size(P.plot_run(metrics, tmp_path / "run.png")) == expected_size(3)


def test_records_of_one_step_merge(tmp_path):
    lines = [
        {"step": 1, "loss": 4.0},
        {"step": 2, "loss": 3.0},
        {"step": 2, "loss": 3.0, "eval_loss": 3.5},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    merged = P._merge_steps(P.read_metrics(path))
    assert merged == [{"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0, "eval_loss": 3.5}]
    assert "eval loss 3.5000 (step 2)" in P._caption(merged)
