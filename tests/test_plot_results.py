"""scripts/plot_results.py on the committed result files: every figure written as a PNG, and
the points it draws are the files' numbers."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plot_results():
    spec = importlib.util.spec_from_file_location(
        "plot_results", ROOT / "scripts" / "plot_results.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_figure_is_a_png_drawn_without_pyplot(plot_results, tmp_path):
    was_loaded = "matplotlib.pyplot" in sys.modules
    path = plot_results.plot_scaling(plot_results.RESULTS, tmp_path / "plots")
    assert path == tmp_path / "plots" / plot_results.SCALING
    assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 10_000
    # Drawn on the Agg canvas, never through pyplot's global state.
    assert ("matplotlib.pyplot" in sys.modules) == was_loaded


@pytest.mark.slow
def test_every_figure_is_written_from_the_committed_files(plot_results, tmp_path):
    written = plot_results.main(["--out", str(tmp_path / "plots")])
    names = [p.name for p in written]
    assert names == [
        plot_results.MOE_LAYER,
        plot_results.GROUPED_GEMM,
        plot_results.TRAINING,
        plot_results.SCALING,
    ]
    for path in written:
        assert path.parent == tmp_path / "plots"
        assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 10_000, path


def test_the_drawn_points_are_the_files_numbers(plot_results):
    results = plot_results.RESULTS
    layer = plot_results.moe_layer_speedups(
        json.loads((results / "moe_layer_h200.json").read_text())
    )
    # bench/results/moe_layer_h200.md's targets table: 2.45x over tokamax (defaults), 3.19x
    # (options) at qwen3_30b_a3b; xla only with the defaults.
    assert round(layer["defaults"][("qwen3_30b_a3b", "tokamax")], 2) == 2.45
    assert round(layer["options"][("qwen3_30b_a3b", "tokamax")], 2) == 3.19
    assert not any(peer == "xla" for _, peer in layer["options"])
    gemm = plot_results.gemm_tflops(json.loads((results / "grouped_gemm_h200.json").read_text()))
    assert round(gemm["forward"][("mixtral_gate_up", "torch")]) == 698
    # tokamax's weight gradient failed its check: not drawn.
    assert ("qwen3_gate_up", "tokamax") not in gemm["wgrad"]
    rows = plot_results.scaling_rows(json.loads((results / "multi_gpu_h200x2.json").read_text()))
    assert rows[("qwen3_30b_a3b", 2, "ragged_all_to_all")]["fwd_bwd_ms"] == 120.331
    assert all(row.get("implementation") in (None, "xla") for row in rows.values())
