"""bench/scan_cost.py on CPU: both variants of the tiny preset's step compile, run and give the
same first loss; the summary's arithmetic."""

from __future__ import annotations

import json

import pytest

from bench import scan_cost


def test_summary_charges_the_difference_to_each_block():
    results = {
        "scan": {"step_ms": 103.0, "first_loss": 5.5},
        "unrolled": {"step_ms": 100.0, "first_loss": 5.5},
    }
    summary = scan_cost.summarize(results, layers=3, full_step_ms=300.0, full_layers=12)
    assert summary["scan_over_unrolled"] == pytest.approx(1.03)
    assert summary["scan_extra_ms_per_block"] == pytest.approx(1.0)
    assert summary["share_of_full_step"] == pytest.approx(12 / 300)
    assert summary["same_first_loss"]
    assert "share_of_full_step" not in scan_cost.summarize(results, 3, None, 12)


@pytest.mark.slow
def test_tiny_preset_both_variants(tmp_path, capsys):
    args = [
        "--preset",
        "tiny",
        "--layers",
        "2",
        "--steps",
        "1",
        "--rounds",
        "1",
        "--batch-size",
        "2",
    ]
    scan_cost.main(["--out", str(tmp_path), *args])
    record = json.loads((tmp_path / "scan_cost.json").read_text())
    results = record["results"]
    assert set(results) == {"scan", "unrolled"}
    for result in results.values():
        assert result["step_ms"] > 0 and len(result["round_ms"]) == 1
    # The same program unrolled: the same arithmetic, so the same loss bits.
    assert record["summary"]["same_first_loss"]
    assert "unrolled: compile" in capsys.readouterr().out
