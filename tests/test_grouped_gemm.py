"""The grouped-GEMM benchmark (bench/grouped_gemm.py) on CPU: routing, the check, the time
budget, the markdown, and smoke runs of what runs here (XLA ragged_dot, our kernels in GPU
interpret mode; torch where installed)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import grouped_gemm as bench

FOUR = "forward,dgrad,wgrad,backward"
SMOKE = ("--smoke", "--products", FOUR, "--xla-products", FOUR)


def test_uniform_group_sizes_sum_to_m_and_repeat():
    sizes = bench.uniform_group_sizes(131072, 128, seed=0)
    assert sizes.dtype == np.int32 and sizes.shape == (128,)
    assert sizes.sum() == 131072
    np.testing.assert_array_equal(sizes, bench.uniform_group_sizes(131072, 128, seed=0))
    assert 131072 / 128 * 0.8 < sizes.min() <= sizes.max() < 131072 / 128 * 1.2


def test_zipf_group_sizes_follow_the_power_law():
    m, g, s = 131072, 128, 1.2
    sizes = bench.zipf_group_sizes(m, g, exponent=s, seed=0)
    assert sizes.sum() == m and sizes.shape == (g,)
    ranked = np.sort(sizes)[::-1].astype(np.float64)
    weights = np.arange(1, g + 1, dtype=np.float64) ** -s
    np.testing.assert_allclose(ranked, m * weights / weights.sum(), atol=1.0)
    assert not np.all(np.diff(sizes) <= 0), "groups are shuffled, not sorted by size"


def test_compare_passes_bf16_rounding_and_fails_a_wrong_row():
    key_a, key_b = jax.random.split(jax.random.key(0))
    ref = jax.random.normal(key_a, (64, 32), jnp.float32)
    assert bench.compare(ref.astype(jnp.bfloat16), ref)["ok"]
    wrong = ref.at[5].set(jax.random.normal(key_b, (32,), jnp.float32))  # another group's row
    assert not bench.compare(wrong, ref)["ok"]
    assert not bench.compare(ref.at[0, 0].set(jnp.nan), ref)["ok"]
    assert not bench.compare(ref[:32], ref)["ok"]


def test_subset_rows_take_both_ends_of_large_groups():
    sizes = np.array([3, 0, 10, 5], np.int32)
    groups = bench.pick_groups(sizes)
    np.testing.assert_array_equal(groups, [0, 2, 3])
    rows, counts = bench.group_rows(sizes, groups, cap=2)
    # group 0 whole (3 <= 2 * cap); groups 2 (rows 3..12) and 3 (rows 13..17): 2 at each end
    np.testing.assert_array_equal(rows, [0, 1, 2, 3, 4, 11, 12, 13, 14, 16, 17])
    np.testing.assert_array_equal(counts, [3, 4, 4])


@pytest.mark.slow
def test_smoke_run_checks_times_and_writes(tmp_path):
    results = bench.main([*SMOKE, "--out", str(tmp_path), "--families", "torch,xla"])
    on_disk = json.loads((tmp_path / "grouped_gemm.json").read_text())
    assert [s["shape"]["name"] for s in on_disk["shapes"]] == [s.name for s in bench.SMOKE_SHAPES]
    for shape in results["shapes"]:
        assert set(shape["products"]) == {"forward", "dgrad", "wgrad", "backward"}
        for entry in shape["products"].values():
            xla = [c for c in entry["candidates"] if c["family"] == "xla"]
            assert xla and all(c["status"] == "ok" for c in xla), xla
            for c in xla:
                assert c["check"]["ok"]
                assert c["bitwise_repeatable"] == {
                    "runs": 3,
                    "identical": True,
                    "outputs_differing": [],
                    "last_timed_run_identical": True,
                }
                assert all("vs_full_reference" in part for part in c["check"]["parts"])
                assert c["timing"]["samples"] == 2 and c["timing"]["median_ms"] > 0
    text = (tmp_path / "grouped_gemm.md").read_text()
    assert "## Targets" in text and "## smoke_uniform" in text and "### wgrad" in text


@pytest.mark.slow
def test_a_run_short_of_time_skips_the_extras_first_and_records_them(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.h.Budget, "elapsed", lambda self: 80.0)  # of 100: 70% is past
    out = ["--out", str(tmp_path), "--families", "xla", "--budget-s", "100"]
    results = bench.main([*SMOKE, *out])
    recs = [
        (product, c)
        for s in results["shapes"]
        for product, entry in s["products"].items()
        for c in entry["candidates"]
    ]
    assert len(recs) == 8
    for product, c in recs:  # XLA's dgrad and wgrad are extras, skipped first
        if product in ("dgrad", "wgrad"):
            assert c["status"] == "skipped: time budget (80 s of 100)", c
        else:
            assert c["status"] == "ok" and c["check"]["ok"], c
    text = (tmp_path / "grouped_gemm.md").read_text()
    assert "## Skipped" in text and "- smoke_zipf1.2 wgrad xla ragged_dot: skipped" in text


def test_a_spent_budget_skips_every_shape_and_says_so(tmp_path):
    results = bench.main(["--smoke", "--budget-s", "0", "--out", str(tmp_path)])
    assert [s["skipped"] for s in results["shapes"]] == ["skipped: time budget (0 s of 0)"] * 2
    assert "- smoke_uniform: skipped: time budget" in (tmp_path / "grouped_gemm.md").read_text()


@pytest.mark.slow
def test_smoke_run_of_our_forward_kernel_in_interpret_mode(tmp_path):
    args = ["--smoke", "--families", "ours", "--products", "forward"]
    out = ["--shapes", "smoke_zipf1.2", "--timed", "1", "--out", str(tmp_path)]
    results = bench.main([*args, *out])
    entry = results["shapes"][0]["products"]["forward"]
    (mosaic,) = [c for c in entry["candidates"] if c["name"] == "ours mosaic_gpu.gmm"]
    assert mosaic["status"] == "ok", mosaic
    assert mosaic["check"]["ok"] and mosaic["check"]["parts"][0]["vs_full_reference"]["ok"]
    assert mosaic["bitwise_repeatable"]["identical"]
    assert mosaic["config"].startswith("TileConfig(")
    assert mosaic["config_source"] == "defaults table (config=None)"


@pytest.mark.slow
def test_a_wrong_candidate_fails_its_check_and_is_not_timed(tmp_path, monkeypatch):
    def wrong_xla(self, product):
        if product != "forward":
            return []
        p = self.p

        def build():  # every row multiplied by group 0's matrix
            return bench.h.jax_runner(lambda x, w, gs: x @ w[0], p.x, p.w, p.gs)

        return [bench.Candidate("wrong", "xla", build)]

    monkeypatch.setattr(bench.Bench, "xla_candidates", wrong_xla)
    out = ["--out", str(tmp_path), "--products", "forward", "--shapes", "smoke_uniform"]
    results = bench.main(["--smoke", "--families", "xla", *out])
    (rec,) = results["shapes"][0]["products"]["forward"]["candidates"]
    assert rec["status"] == "failed check (not timed)" and "timing" not in rec
    assert not rec["check"]["parts"][0]["vs_reference_subset"]["ok"]


def _ragged_dot(x, w, gs):
    return jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(x.dtype)


def _stand_ins(monkeypatch):
    """torch and ours both XLA's ragged_dot (forward only): the harness's wiring, cheaply."""

    def torch_candidates(self, product):
        p = self.p
        build = lambda: bench.h.jax_runner(_ragged_dot, p.x, p.w, p.gs)  # noqa: E731
        return (
            [bench.Candidate("torch._grouped_mm", "torch", build)] if product == "forward" else []
        )

    def ours_candidates(self, product):
        p = self.p
        build = lambda: bench.h.jax_runner(_ragged_dot, p.x, p.w, p.gs)  # noqa: E731
        return (
            [bench.Candidate("ours mosaic_gpu.gmm", "ours", build)] if product == "forward" else []
        )

    monkeypatch.setattr(bench.Bench, "torch_candidates", torch_candidates)
    monkeypatch.setattr(bench.Bench, "ours_candidates", ours_candidates)


@pytest.mark.parametrize("paired", [True, False])
def test_ours_are_timed_paired_with_torch_and_the_others_are_not(tmp_path, monkeypatch, paired):
    _stand_ins(monkeypatch)
    flags = ["--smoke", "--families", "torch,ours,xla", "--products", "forward"]
    out = ["--shapes", "smoke_uniform", "--timed", "4", "--out", str(tmp_path)]
    results = bench.main([*flags, *out, *([] if paired else ["--no-paired"])])
    torch_rec, ours, xla = results["shapes"][0]["products"]["forward"]["candidates"]
    assert [c["family"] for c in (torch_rec, ours, xla)] == ["torch", "ours", "xla"]
    assert all(c["status"] == "ok" for c in (torch_rec, ours, xla))
    assert "paired" not in torch_rec and "paired" not in xla and "x_torch_paired" not in xla
    assert xla["x_torch"] == torch_rec["timing"]["median_ms"] / xla["timing"]["median_ms"]
    text = (tmp_path / "grouped_gemm.md").read_text()
    targets = text.split("## Targets")[1].split("\n## ")[0]
    (target_row,) = [line for line in targets.splitlines() if line.startswith("| smoke_uniform |")]
    if not paired:
        assert "x_torch_paired" not in ours and "paired" not in ours
        assert target_row.startswith(f"| smoke_uniform | {ours['x_torch']:.3f}x (")
        return
    ratios = ours["paired"]["base_over_this"]
    torch_ms = np.array(ours["paired"]["base_timing"]["samples_ms"])
    ours_ms = np.array(ours["timing"]["samples_ms"])
    assert len(torch_ms) == len(ours_ms) == len(ratios["ratios"]) == 4
    np.testing.assert_allclose(ratios["ratios"], torch_ms / ours_ms, rtol=1e-3)
    assert (
        ours["x_torch_paired"]
        == ratios["median"]
        == pytest.approx(np.median(torch_ms / ours_ms), rel=1e-3)  # samples_ms: 5 decimals
    )
    assert ours["x_torch_paired_p25_p75"] == [ratios["p25"], ratios["p75"]]
    lo, hi = ours["x_torch_paired_p25_p75"]
    assert target_row.startswith(
        f"| smoke_uniform | {ours['x_torch_paired']:.3f}x paired [{lo:.3f}-{hi:.3f}] "
        f"(unpaired {ours['x_torch']:.3f}x) ("
    )
    assert "forward x torch, paired (>= 1.0)" in text
    (row,) = [line for line in text.splitlines() if line.startswith("| forward | ours mosaic")]
    assert f"| {ours['x_torch_paired']:.3f} [{lo:.3f}-{hi:.3f}]; torch " in row


def test_markdown_judges_a_target_on_the_paired_ratio_and_shows_the_unpaired():
    results = _forward_result(
        **{
            "torch._grouped_mm": ("torch", 700.0, False),
            "ours mosaic_gpu.gmm": ("ours", 679.0, False),  # 0.97x torch, timed apart
        }
    )
    ours = results["shapes"][0]["products"]["forward"]["candidates"][1]
    ours.update(x_torch_paired=1.012, x_torch_paired_p25_p75=[1.004, 1.020])
    ours["paired"] = {"base_timing": {"median_ms": 1.25}, "base_over_this": {}}
    text = bench.render_markdown(results)
    assert "| qwen3_gate_up | 1.012x paired [1.004-1.020] (unpaired 0.970x) (met) |" in text
    ours["x_torch_paired"] = 0.99
    text = bench.render_markdown(results)
    assert "| qwen3_gate_up | 0.990x paired [1.004-1.020] (unpaired 0.970x) (**missed**) |" in text


def _forward_result(**candidates):
    shape = bench.SHAPES[0]  # qwen3 gate_up: DESIGN.md has torch 655, tokamax 280
    flops, _ = bench.product_cost(shape, "forward")
    recs = []
    for name, (family, tflops, extra) in candidates.items():
        ms = flops / (tflops * 1e12) * 1e3
        rec = {
            "name": name,
            "family": family,
            "extra": extra,
            "status": "ok",
            "check": {"ok": True},
            "timing": {"median_ms": ms, "min_ms": ms, "max_ms": ms},
            "tflops": tflops,
            "bitwise_repeatable": {"runs": 3, "identical": True, "last_timed_run_identical": True},
        }
        if family == "ours":
            rec["config"] = "TileConfig(block_m=128, block_n=256)"
            rec["config_source"] = "defaults table (config=None)"
        recs.append(rec)
    entry = {"flops": flops, "candidates": recs}
    bench._ratios(entry)
    env = {key: "-" for key in ("command", "date", "device", "git_commit")}
    env["versions"] = {"jax": "-"}
    return {
        "environment": env,
        "method": "-",
        "shapes": [
            {
                "shape": dataclasses.asdict(shape),
                "routing": "-",
                "group_sizes": {"min": 1, "median": 1.0, "max": 1, "empty": 0},
                "products": {
                    "forward": entry,
                    "dgrad": {"flops": flops, "skipped": "skipped: time budget (test)"},
                },
            }
        ],
    }


def test_markdown_tables_ratios_configs_and_design_deviation():
    results = _forward_result(
        **{
            "torch._grouped_mm": ("torch", 700.0, False),  # +6.9% of 655: not flagged
            "ours mosaic_gpu.gmm": ("ours", 770.0, False),  # 1.10x torch
            "tokamax mosaic": ("tokamax", 200.0, False),  # -28.6% of 280: flagged
        }
    )
    text = bench.render_markdown(results)
    assert "| qwen3_gate_up | 1.100x (met) | skipped |" in text
    assert "bitwise x3: yes |" in text
    assert "| qwen3_gate_up | 700.0 (1.00x) | 770.0 (1.10x) | 200.0 (0.29x) |" in text
    rows = [line for line in text.splitlines() if line.startswith("| qwen3_gate_up | torch.")]
    assert rows and "+6.9%" in rows[0] and "FLAG" not in rows[0]
    (tokamax,) = [line for line in text.splitlines() if "| tokamax mosaic | 280 |" in line]
    assert "-28.6% **FLAG**" in tokamax
    design_ms, measured_ms = (float(x) for x in tokamax.split(" | ")[5:7])
    assert measured_ms / design_ms == pytest.approx(280 / 200, rel=1e-3)
    assert "| qwen3_gate_up | forward | ours mosaic_gpu.gmm | TileConfig(block_m=128" in text
    assert "- qwen3_gate_up dgrad: skipped: time budget (test)" in text


def test_markdown_flags_a_kernel_that_is_slower_or_not_repeatable():
    results = _forward_result(
        **{
            "torch._grouped_mm": ("torch", 700.0, False),
            "ours mosaic_gpu.gmm": ("ours", 350.0, False),
        }
    )
    entry = results["shapes"][0]["products"]["forward"]
    entry["candidates"][1]["bitwise_repeatable"]["last_timed_run_identical"] = False
    text = bench.render_markdown(results)
    assert "| qwen3_gate_up | 0.500x (**missed**) |" in text
    assert "bitwise x3: yes; last timed run: **NO** |" in text
