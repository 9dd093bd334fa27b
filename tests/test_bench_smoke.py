"""The grouped-GEMM benchmark harness (bench/grouped_gemm_h200.py) on CPU: routing, the check,
and a smoke run of the baselines that run here (XLA ragged_dot; torch where installed)."""

from __future__ import annotations

import json

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
                assert c["check"]["ok"] and c["bitwise_repeatable"]["identical"]
                assert all("vs_full_reference" in part for part in c["check"]["parts"])
                assert c["timing"]["samples"] == 2 and c["timing"]["median_ms"] > 0
    text = (tmp_path / "grouped_gemm_h200.md").read_text()
    assert "## Targets" in text and "## smoke_uniform" in text


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
