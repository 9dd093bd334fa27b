"""The grouped-GEMM benchmark harness (bench/grouped_gemm_h200.py) on CPU: routing, the check,
the time plan and its watchdog, the markdown, and smoke runs of what runs here (XLA ragged_dot,
our kernels in GPU interpret mode; torch where installed)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import grouped_gemm_h200 as bench

FOUR = "forward,dgrad,wgrad,backward"
SMOKE = ("--smoke", "--no-ceilings", "--products", FOUR, "--xla-products", FOUR)


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
    on_disk = json.loads((tmp_path / "grouped_gemm_h200.json").read_text())
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
                    "last_timed_run_identical": True,
                }
                assert all("vs_full_reference" in part for part in c["check"]["parts"])
                assert c["timing"]["samples"] == 2 and c["timing"]["median_ms"] > 0
    tiers = on_disk["plan"]["tiers"]
    assert sum(t["skipped"] for t in tiers.values()) == 0
    assert sum(t["done"] for t in tiers.values()) == sum(t["steps"] for t in tiers.values())
    text = (tmp_path / "grouped_gemm_h200.md").read_text()
    assert "## Targets" in text and "## smoke_uniform" in text and "### wgrad" in text


@pytest.mark.slow
def test_a_run_short_of_time_skips_and_records_the_baselines(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "XLA_COMPILE_S", 1e4)  # no XLA candidate fits the budget
    out = ["--out", str(tmp_path), "--families", "xla", "--budget-s", "600"]
    results = bench.main([*SMOKE, *out])
    recs = [
        c
        for s in results["shapes"]
        for entry in s["products"].values()
        for c in entry["candidates"]
    ]
    assert [s["shape"]["name"] for s in results["shapes"]] == ["smoke_uniform", "smoke_zipf1.2"]
    assert len(recs) == 8
    for c in recs:  # deferred by the first pass, skipped by the second
        assert c["status"].startswith("skipped: time budget (second pass: "), c
        assert "; first pass: deferred: time budget (needs ~10000 s" in c["status"]
    assert all("reference_s" in e for s in results["shapes"] for e in s["products"].values())
    tiers = results["plan"]["tiers"]
    assert tiers["0"]["skipped"] == 0
    assert [tiers[t]["skipped"] for t in "123"] == [2, 2, 4]  # forward; backward; dgrad, wgrad
    text = (tmp_path / "grouped_gemm_h200.md").read_text()
    assert "## Skipped" in text and "smoke_zipf1.2 backward xla ragged_dot VJP: skipped" in text


@pytest.mark.slow
def test_smoke_run_of_our_forward_kernel_in_interpret_mode(tmp_path):
    args = ["--smoke", "--no-ceilings", "--families", "ours", "--products", "forward"]
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
            return bench.jax_runner(lambda x, w, gs: x @ w[0], p.x, p.w, p.gs)

        return [bench.Candidate("wrong", "xla", build)]

    monkeypatch.setattr(bench.Bench, "xla_candidates", wrong_xla)
    out = ["--out", str(tmp_path), "--products", "forward", "--shapes", "smoke_uniform"]
    results = bench.main(["--smoke", "--no-ceilings", "--families", "xla", *out])
    (rec,) = results["shapes"][0]["products"]["forward"]["candidates"]
    assert rec["status"] == "failed check (not timed)" and "timing" not in rec
    assert not rec["check"]["parts"][0]["vs_reference_subset"]["ok"]


def _steps(*specs):
    """Steps (tier, static seconds) of one shape and product, in run order."""
    return [
        bench.Step("s", "forward", f"c{i}", "torch", tier, "gemm", est)
        for i, (tier, est) in enumerate(specs)
    ]


def test_planner_holds_time_for_higher_tiers_and_learns_from_what_ran():
    steps = _steps((2, 10.0), (0, 30.0), (1, 10.0))
    planner = bench.Planner(50.0, steps)
    planner.defer = False  # as in the second pass (the first defers: tested below)
    # The extra (tier 2) needs 10 s, but tiers 0 and 1 still need 40 s of the 50: skipped.
    reason = planner.admit(steps[0])
    assert reason is not None and reason.startswith("skipped: time budget")
    assert "40 s held for tiers < 2" in reason and steps[0].state == "skipped"
    assert planner.admit(steps[1]) is None and steps[1].state == "running"
    planner.finish(steps[1], 2.0)
    # Measured 2 s for (torch, gemm): 1.5x that replaces the table's 10 s for the next one.
    assert planner.estimate(steps[2]) == pytest.approx(3.0)
    assert planner.admit(steps[2]) is None
    summary = planner.summary()
    assert summary["tiers"]["2"]["skipped"] == 1 and summary["tiers"]["0"]["done"] == 1
    assert summary["static_estimate_s"] == 50.0


def test_planner_skips_what_would_end_past_the_budget():
    steps = _steps((0, 30.0))
    planner = bench.Planner(100.0, steps, started_at=time.time() - 80.0)  # 20 s left
    assert not planner.fits(steps[0])
    assert planner.admit(steps[0]).startswith("skipped: time budget (needs ~30 s; 20 s of 100")


def test_the_plan_of_the_full_run_lists_every_candidate_by_tier():
    plan = bench.main(["--plan"])
    steps = {(s["shape"], s["product"], s["name"]): s for s in plan["steps"]}
    shapes = [s.name for s in bench.SHAPES]
    assert {s["shape"] for s in plan["steps"]} == {"", *shapes}
    for shape in shapes:
        assert steps[shape, "forward", "torch._grouped_mm"]["tier"] == 0
        assert steps[shape, "forward", "ours mosaic_gpu.gmm"]["tier"] == 0
        assert steps[shape, "wgrad", "ours tgmm (bf16 out)"]["tier"] == 0
        assert steps[shape, "forward", "xla ragged_dot"]["tier"] == 1
        assert steps[shape, "dgrad", "xla ragged_dot"]["tier"] == 3
        assert steps[shape, "dgrad", "tokamax mosaic"]["tier"] == 2
        assert steps[shape, "forward", "ours triton.gmm"]["tier"] == 3
    # XLA's weight gradient at qwen3 gate_up needs 120 GiB of dense operands: refused, ~1 s.
    assert steps["qwen3_gate_up", "wgrad", "xla ragged_dot"]["static_s"] == 1.0
    # Measured before at mixtral (1.25x that wall); never at dsv3 down (compile + its calls).
    assert steps["mixtral_gate_up", "wgrad", "xla ragged_dot"]["static_s"] == 1.25 * 3.9
    assert steps["dsv3_ep8_down", "wgrad", "xla ragged_dot"]["static_s"] > bench.XLA_COMPILE_S
    # One reference step per product, none for backward (dgrad's and wgrad's parts serve it).
    assert ("qwen3_down", "backward", "reference.py") not in steps
    assert steps["qwen3_down", "wgrad", "reference.py"]["units"] == 1
    total = sum(s["static_s"] for s in plan["steps"])
    assert plan["plan"]["static_estimate_s"] == pytest.approx(total, abs=0.1)


def test_a_slow_call_is_its_own_warm_up_and_keeps_its_samples():
    calls = []

    def call():
        calls.append(time.perf_counter())
        time.sleep(bench.SLOW_CALL_S * 1.2)
        return len(calls)

    runner = bench.Runner(call=call, sync=lambda _: None, to_jax=None, compile_s=0.0, info={})
    keep = {}
    timing = bench.time_runner(runner, warmup=3, timed=10, target_sample_s=0.005, keep=keep)
    assert len(calls) == 11 and timing["warmup"] == 1 and timing["samples"] == 10
    assert timing["reps_per_sample"] == 1 and keep["out"] == 11


class _DriftingDevice:
    """A fake device and host clock: a call takes its base time times a slowdown that grows with
    the clock (clocks, temperature, power drifting through a run); calls are synchronous."""

    def __init__(self, slowdown_per_s: float):
        self.now, self.rate, self.calls = 0.0, slowdown_per_s, []

    def perf_counter(self) -> float:
        return self.now

    def runner(self, name: str, base_s: float) -> bench.Runner:
        def call():
            self.calls.append(name)
            self.now += base_s * (1.0 + self.rate * self.now)
            return name

        return bench.Runner(call=call, sync=lambda _: None, to_jax=None, compile_s=0.0, info={})


def test_the_paired_ratio_holds_under_drift_where_the_ratio_of_medians_does_not(monkeypatch):
    device = _DriftingDevice(slowdown_per_s=1.0)  # 5% slower after 50 ms of calls
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=device.perf_counter))
    torch_side, ours = device.runner("torch", 1e-3), device.runner("ours", 0.95e-3)
    truth = 1.0 / 0.95  # torch's time over ours at the same device state
    how = dict(warmup=3, timed=10, target_sample_s=0.005)

    # Unpaired, as every other candidate: torch timed, then ours (the drift in between).
    torch_alone = bench.time_runner(torch_side, **how)
    ours_alone = bench.time_runner(ours, **how)
    unpaired = torch_alone["median_ms"] / ours_alone["median_ms"]
    assert abs(unpaired - truth) > 0.04, unpaired

    # Paired, later still (the device slower yet): the ratio stays right.
    device.calls.clear()
    keep = {}
    timing, torch_timing, ratios = bench.time_paired(torch_side, ours, **how, keep=keep)
    assert ratios["median"] == pytest.approx(truth, abs=0.01)
    assert ratios["p25"] <= ratios["median"] <= ratios["p75"]
    assert ratios["p75"] - ratios["p25"] < 0.01
    assert len(ratios["ratios"]) == 10 and keep["out"] == "ours"
    np.testing.assert_allclose(
        ratios["ratios"],
        np.array(torch_timing["samples_ms"]) / np.array(timing["samples_ms"]),
        rtol=1e-3,
    )
    # Each side warmed up and calibrated as time_runner does, then the samples alternate.
    reps_t, reps_o = torch_timing["reps_per_sample"], timing["reps_per_sample"]
    assert reps_t > 1 and reps_o > 1 and timing["warmup"] == torch_timing["warmup"] == 5
    assert device.calls[:10] == ["torch"] * 5 + ["ours"] * 5
    assert device.calls[10:] == (["torch"] * reps_t + ["ours"] * reps_o) * 10
    # The medians of the same samples, taken apart, carry the drift between the two sides.
    assert timing["median_ms"] > ours_alone["median_ms"] > 0.95 * (1 + 0.05)


def _ragged_dot(x, w, gs):
    return jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(x.dtype)


def _stand_ins(monkeypatch):
    """torch and ours both XLA's ragged_dot (forward only): the harness's wiring, cheaply."""

    def torch_candidates(self, product):
        p = self.p
        build = lambda: bench.jax_runner(_ragged_dot, p.x, p.w, p.gs)  # noqa: E731
        return (
            [bench.Candidate("torch._grouped_mm", "torch", build)] if product == "forward" else []
        )

    def ours_candidates(self, product):
        p = self.p
        build = lambda: bench.jax_runner(_ragged_dot, p.x, p.w, p.gs)  # noqa: E731
        return (
            [bench.Candidate("ours mosaic_gpu.gmm", "ours", build)] if product == "forward" else []
        )

    monkeypatch.setattr(bench.Bench, "torch_candidates", torch_candidates)
    monkeypatch.setattr(bench.Bench, "ours_candidates", ours_candidates)


@pytest.mark.parametrize("paired", [True, False])
def test_ours_are_timed_paired_with_torch_and_the_others_are_not(tmp_path, monkeypatch, paired):
    _stand_ins(monkeypatch)
    flags = ["--smoke", "--no-ceilings", "--families", "torch,ours,xla", "--products", "forward"]
    out = ["--shapes", "smoke_uniform", "--timed", "4", "--out", str(tmp_path)]
    results = bench.main([*flags, *out, *([] if paired else ["--no-paired"])])
    torch_rec, ours, xla = results["shapes"][0]["products"]["forward"]["candidates"]
    assert [c["family"] for c in (torch_rec, ours, xla)] == ["torch", "ours", "xla"]
    assert all(c["status"] == "ok" for c in (torch_rec, ours, xla))
    assert "paired" not in torch_rec and "paired" not in xla and "x_torch_paired" not in xla
    assert xla["x_torch"] == torch_rec["timing"]["median_ms"] / xla["timing"]["median_ms"]
    text = (tmp_path / "grouped_gemm_h200.md").read_text()
    targets = text.split("## Targets")[1].split("\n## ")[0]
    (target_row,) = [line for line in targets.splitlines() if line.startswith("| smoke_uniform |")]
    if not paired:
        assert "x_torch_paired" not in ours and "paired" not in ours
        assert target_row.startswith(f"| smoke_uniform | {ours['x_torch']:.3f}x (")
        return
    ratios = ours["paired"]["x_torch"]
    torch_ms = np.array(ours["paired"]["torch_timing"]["samples_ms"])
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
    ours["paired"] = {"torch_timing": {"median_ms": 1.25}, "x_torch": {}}
    text = bench.render_markdown(results)
    assert "| qwen3_gate_up | 1.012x paired [1.004-1.020] (unpaired 0.970x) (met) |" in text
    ours["x_torch_paired"] = 0.99
    text = bench.render_markdown(results)
    assert "| qwen3_gate_up | 0.990x paired [1.004-1.020] (unpaired 0.970x) (**missed**) |" in text


def test_the_watchdog_stops_the_run_naming_the_running_step():
    (step,) = _steps((0, 1.0))
    planner = bench.Planner(10.0, [step])
    assert planner.admit(step) is None
    stopped = threading.Event()
    reasons = []

    def stop(reason):
        reasons.append(reason)
        stopped.set()

    bench.Watchdog(planner, planner.elapsed() + 0.05, stop).start()
    assert stopped.wait(10.0)
    assert reasons[0].startswith("stopped by the watchdog at ")
    assert reasons[0].endswith("while running: s forward c0")


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
    env = {
        key: "-"
        for key in ("command", "device_command", "date_utc", "device", "backend", "jax", "torch")
    }
    env.update(tokamax="-", triton="-", git_commit="-")
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


def test_the_first_pass_defers_baselines_and_the_second_plans_them_again():
    steps = _steps((0, 30.0), (1, 10.0), (2, 5.0))
    planner = bench.Planner(35.0, steps)
    assert planner.admit(steps[2]).startswith("deferred: time budget (needs ~5 s + 40 s held")
    assert planner.admit(steps[1]).startswith("deferred: time budget")
    assert planner.admit(steps[0]) is None  # tier 0 is never deferred
    planner.finish(steps[0], 20.0)
    assert planner.summary()["tiers"]["1"]["deferred"] == 1
    again = planner.plan_deferred_again()
    assert again == {"s": [steps[1], steps[2]]}
    assert all(s.state == "planned" for s in again["s"])
    # No more deferring: the tier-2 step holds time for the tier-1 one, and does not fit.
    assert planner.admit(steps[2]).startswith("skipped: time budget")
    assert planner.admit(steps[1]) is None


def _first_pass(tmp_path, budget_s):
    flags = ["--smoke", "--no-ceilings", "--families", "xla", "--shapes", "smoke_zipf1.2"]
    args = bench.parse_args([*flags, "--products", "forward,wgrad", "--out", str(tmp_path)])
    args.torch_missing = "not installed here"
    planner = bench.Planner(budget_s, bench.plan_steps(args, None, ceilings=False))
    shape = args.shape_list[0]
    result = bench.run_problem(shape, args, planner, None, lambda _: None)
    # As if the first pass had deferred XLA's wgrad: its step and its record.
    step = planner.step(shape.name, "wgrad", "xla ragged_dot")
    step.state = "deferred"
    entry = result["products"]["wgrad"]
    (rec,) = entry["candidates"]
    assert rec["status"] == "ok"
    entry["candidates"] = [{**rec, "status": "deferred: time budget (test)"}]
    return args, planner, shape, result, step


@pytest.mark.slow
def test_the_second_pass_runs_what_was_deferred_and_replaces_its_record(tmp_path):
    args, planner, shape, result, step = _first_pass(tmp_path, 600.0)
    again = planner.plan_deferred_again()
    saved = []
    bench.rerun_deferred(shape, args, planner, None, result, saved.append, again[shape.name])
    (rec,) = result["products"]["wgrad"]["candidates"]
    assert rec["status"] == "ok" and rec["second_pass"] and rec["check"]["ok"]
    assert rec["bitwise_repeatable"]["identical"] and step.state == "done" and saved


@pytest.mark.slow
def test_the_second_pass_records_what_still_does_not_fit(tmp_path):
    args, planner, shape, result, step = _first_pass(tmp_path, 600.0)
    planner.budget_s = planner.elapsed() + 1.0  # the compile estimate alone is 18 s
    again = planner.plan_deferred_again()
    bench.rerun_deferred(shape, args, planner, None, result, lambda _: None, again[shape.name])
    (rec,) = result["products"]["wgrad"]["candidates"]
    assert rec["status"].startswith("skipped: time budget (second pass: ")
    assert rec["status"].endswith("first pass: deferred: time budget (test)")
    assert step.state == "skipped"


def test_a_call_of_main_counts_its_budget_from_the_call(tmp_path, monkeypatch):
    """The module may be imported long before main() runs (pytest collects, then runs a long
    suite): the budget and the watchdog count from the call, not from the import. When they
    counted from the import, the watchdog ended the pytest worker mid-suite."""
    monkeypatch.setattr(bench, "PROCESS_START", time.time() - 10_000.0)
    out = ["--out", str(tmp_path), "--families", "xla", "--products", "forward"]
    results = bench.main(["--smoke", "--no-ceilings", "--xla-products", "forward", *out])
    assert "stopped" not in results
    assert results["elapsed_s"] < 540.0


def test_gmm_probe_fixed_share_is_the_part_that_does_not_scale_with_k():
    from bench import gmm_probe

    def record(k, ours_ms, torch_ms):
        return {"shape": "s", "variant": "ours", "k": k, "ours_ms": ours_ms, "torch_ms": torch_ms}

    # ours: 1 ms fixed + 4 ms per K; torch: no fixed part.
    rows = gmm_probe.fixed_shares([record(1024, 5.0, 4.0), record(2048, 9.0, 8.0)])
    assert rows == [
        {
            "shape": "s",
            "variant": "ours",
            "k": 1024,
            "ours_fixed_share": 0.2,
            "torch_fixed_share": 0.0,
        }
    ]


def test_gmm_profile_sustain_reports_calls_clocks_and_reasons(monkeypatch):
    from bench import gmm_profile

    readings = iter([[1980.0, 610.0, 55.0, 0.0], [1755.0, 700.0, 61.0, 4.0]] * 1000)
    monkeypatch.setattr(gmm_profile, "_read_smi", lambda: next(readings))
    synced = []
    row = gmm_profile.sustain("fake", lambda: 1, synced.append, 0.5)
    assert row["calls"] == 10 * len(synced) and row["calls"] >= 10
    assert row["ms_per_call"] == pytest.approx(row["seconds"] / row["calls"] * 1e3)
    assert row["smi_samples"] >= 2
    assert 1755.0 <= row["sm_mhz_median"] <= 1980.0 and row["sm_mhz_min"] == 1755.0
    assert row["temperature_c_max"] == 61.0
    assert row["clock_event_reasons_seen"] == ["0x0", "0x4"]
    assert gmm_profile._parse_smi("1980, 612.35, 55, 0x0000000000000004") == [
        1980.0,
        612.35,
        55.0,
        4.0,
    ]


def test_gmm_profile_report_names_torch_and_our_kernels_and_skips_the_rest(tmp_path):
    from bench import gmm_profile

    header = "ID,Kernel Name,Section Name,Metric Name,Metric Unit,Metric Value\n"
    body = [
        '0,"void at::prepare_grouped_gemm_data<cutlass::x>",GPU Speed Of Light Throughput,'
        "Duration,us,2.0",
        '1,"void cutlass::device_kernel<gemm>",GPU Speed Of Light Throughput,Duration,ms,5.24',
        '1,"void cutlass::device_kernel<gemm>",GPU Speed Of Light Throughput,SM Frequency,Ghz,1.53',
        "2,input_concatenate_fusion,GPU Speed Of Light Throughput,Duration,us,2.9",
        "3,anonymous_mosaic_gpu_kernel,GPU Speed Of Light Throughput,Duration,ms,5.23",
        "4,anonymous_mosaic_gpu_kernel,GPU Speed Of Light Throughput,Duration,ms,5.56",
        "4,anonymous_mosaic_gpu_kernel,Occupancy,Max Active Clusters,cluster,66",
    ]
    path = tmp_path / "ncu.csv"
    path.write_text(header + "\n".join(body) + "\n")
    table = gmm_profile.ncu_report([path], ["default", "cluster2"]).splitlines()
    assert table[2] == "| metric | torch._grouped_mm | default | cluster2 |"
    assert "| Duration | 5.24 ms | 5.23 ms | 5.56 ms |" in table
    assert "| SM Frequency | 1.53 Ghz | - | - |" in table
    assert "| Max Active Clusters | - | - | 66 cluster |" in table
    assert not any("2.9" in line or "2.0 us" in line for line in table)
    (tmp_path / "empty.csv").write_text(header + body[3] + "\n")
    with pytest.raises(ValueError, match="no grouped GEMM launch"):
        gmm_profile.ncu_report([tmp_path / "empty.csv"])


def test_moe_layer_plan_lists_every_shape_and_candidate_by_tier():
    from bench import moe_layer_h200 as layer

    plan = layer.main(["--plan"])
    steps = {(s["shape"], s["product"], s["name"]): s for s in plan["steps"]}
    assert {s["shape"] for s in plan["steps"]} == {s.name for s in layer.SHAPES}
    assert len(layer.SHAPES) == 4 and layer.SHAPES[-1].routing == "zipf"
    for shape in layer.SHAPES:
        assert steps[shape.name, "setup", "reference"]["tier"] == 0
        for product in layer.PRODUCTS:
            for key in layer.CANDIDATES:
                step = steps[shape.name, product, layer.TITLES[key]]
                assert step["family"] == key
                assert step["tier"] == (layer.PRODUCTS.index(product) + 1 if key == "xla" else 0)
    assert len(plan["steps"]) == 4 * (2 + 2 * 6)
    # The xla layer: never calibrated, estimated from DESIGN.md's per-call times.
    xla = steps["dsv3_slice", "fwd_bwd", layer.TITLES["xla"]]["static_s"]
    assert xla == pytest.approx(layer.XLA_COMPILE_S + layer.XLA_CALLS * 0.743 + 0.3)
    assert plan["plan"]["tiers"]["2"]["what"] == "mok_jax xla forward+backward"


def test_moe_layer_capped_zipf_loads_sum_to_the_rows_and_respect_the_cap():
    from bench import moe_layer_h200 as layer

    loads = layer.capped_zipf_loads(16384 * 8, 128, 16384, 1.2)
    assert loads.sum() == pytest.approx(16384 * 8) and loads.max() <= 16384
    assert list(loads[:2]) == [16384, 16384] and 16384 > loads[2] > loads[3] > loads[-1] > 0
    ranks = np.arange(3, 129, dtype=np.float64)  # uncapped ranks keep the power law
    np.testing.assert_allclose(loads[2:] / loads[2], (ranks / 3) ** -1.2)


@pytest.mark.slow
def test_moe_layer_smoke_checks_times_and_marks_gpu_baselines_not_available(tmp_path):
    import importlib.util

    from bench import moe_layer_h200 as layer

    args = ["--smoke", "--shapes", "smoke_mixtral", "--products", "forward"]
    results = layer.main([*args, "--out", str(tmp_path)])
    on_disk = json.loads((tmp_path / "moe_layer_h200.json").read_text())
    assert [s["shape"]["name"] for s in on_disk["shapes"]] == ["smoke_mixtral"]
    entry = results["shapes"][0]["products"]["forward"]
    recs = {c["key"]: c for c in entry["candidates"]}
    assert list(recs) == ["fused", "tokamax", "torch", "torch_det", "xla"]
    assert entry["anchor"] == "fused" and recs["fused"]["anchor"]
    for key in ("fused", "xla"):
        rec = recs[key]
        assert rec["status"] == "ok", rec
        assert rec["check"]["outputs"]["y"]["vs_reference_first_tokens"]["ok"]
        assert rec["bitwise_repeatable"] == {
            "runs": 3,
            "identical": True,
            "outputs_differing": [],
            "last_timed_run_identical": True,
        }
        assert rec["timing"]["samples"] == 2 and rec["timing"]["median_ms"] > 0
    assert recs["xla"]["check"]["outputs"]["y"]["vs_fused"]["ok"]
    assert len(recs["xla"]["paired"]["ratios"]["ratios"]) == 2  # timed in alternation with fused
    assert recs["xla"]["fused_speedup"] > 0 and "fused_speedup" not in recs["fused"]
    assert recs["tokamax"]["status"].startswith("not available: needs a CUDA GPU")
    if importlib.util.find_spec("torch") is None:
        for key in ("torch", "torch_det"):
            assert recs[key]["status"].startswith("not available: import torch"), recs[key]
    text = (tmp_path / "moe_layer_h200.md").read_text()
    assert "## smoke_mixtral: T=64" in text and "| 2. MaxText recipe + tokamax mosaic |" in text
    assert "not available" in text and "SMOKE RUN" in text


def test_moe_layer_fused_options_set_the_fused_config_and_reject_unknown_fields():
    from bench import moe_layer_h200 as layer

    args = layer.parse_args(["--fused-options", "residuals=gate_up,token_chunk=2048"])
    assert args.fused_options == {"residuals": "gate_up", "token_chunk": 2048}
    bench = layer.Bench(args, None, layer.SHAPES[0])
    assert bench._computes("fused").endswith("; with " + str(args.fused_options))
    assert bench._computes("pallas") == layer.COMPUTES["pallas"]
    with pytest.raises(SystemExit):  # MoEConfig's field before the options moved
        layer.parse_args(["--fused-options", "fused_residuals=gate_up"])
    with pytest.raises(SystemExit):  # a MoEConfig field, not an option
        layer.parse_args(["--fused-options", "row_tile=128"])


@pytest.mark.slow
def test_moe_layer_fwd_bwd_returns_y_not_the_cancelling_loss():
    """fwd_bwd's outputs are y (the forward's bits, checked entry by entry) and the gradients of
    sum(y * cot); the loss itself, a sum that cancels, is not among them."""
    from bench import moe_layer_h200 as layer
    from mok_jax import init_params, moe

    shape = layer.SMOKE_SHAPES[0]
    cfg = shape.config("xla")
    kx, kp, kc = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (16, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
    cot = jax.random.normal(kc, x.shape, jnp.float32).astype(jnp.bfloat16)
    params = init_params(kp, cfg, dtype=jnp.bfloat16)

    def fn(x, p):
        return moe(x, p, cfg)[0]

    names = layer.output_names("fwd_bwd", shared=False)
    assert names[:2] == ("y", "dx") and "loss" not in names
    outs = jax.jit(layer.jax_products(fn, "fwd_bwd", False))(x, params, cot)
    assert len(outs) == len(names)
    # Against y and dx from programs of their own (close, not bitwise: XLA may fuse each
    # program differently); a loss in place of y would fail on its shape.
    (y,) = jax.jit(layer.jax_products(fn, "forward", False))(x, params, cot)
    dx = jax.jit(
        jax.grad(lambda x: jnp.sum(fn(x, params).astype(jnp.float32) * cot.astype(jnp.float32)))
    )(x)
    for out, expected in ((outs[0], y), (outs[1], dx)):
        assert out.shape == expected.shape and out.dtype == expected.dtype
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(expected, np.float32), rtol=2**-7, atol=2**-7
        )


def test_gemm_options_times_the_backward_products_and_sums_their_bits(monkeypatch):
    from bench import gemm_options

    monkeypatch.setitem(gemm_options.SHAPES, "tiny", (32, 16, 8))
    got = gemm_options.measure("cublas_untuned", "tiny")
    assert got["ms"] > 0 and got["tflops"] == pytest.approx(4 * 32 * 16 * 8 / got["ms"] / 1e9)
    # dx and dw: their bf16 bits summed, the same in a second call.
    assert len(got["checksum"]) == 2
    assert got["checksum"] == gemm_options.measure("cublas_untuned", "tiny")["checksum"]
