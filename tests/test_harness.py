"""bench/harness on CPU: the timing of a slow call, paired timing under drift, the elementwise
check, the bitwise repeats and `measure`'s refusal to time a candidate that fails its check."""

from __future__ import annotations

import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import harness as h
from bench.harness import timing


def test_compare_passes_bf16_rounding_and_fails_a_wrong_row():
    key_a, key_b = jax.random.split(jax.random.key(0))
    ref = jax.random.normal(key_a, (64, 32), jnp.float32)
    for scale in ("rms", "max"):
        compare = lambda out, scale=scale: h.compare(out, ref, rtol=2**-6, atol=2**-6, scale=scale)  # noqa: E731
        assert compare(ref.astype(jnp.bfloat16))["ok"]
        wrong = ref.at[5].set(jax.random.normal(key_b, (32,), jnp.float32))  # another row
        assert not compare(wrong)["ok"]
        assert not compare(ref.at[0, 0].set(jnp.nan))["ok"]
        assert not compare(ref[:32])["ok"]


def test_bits_equal_tells_the_last_bit_and_the_dtype():
    a = jnp.arange(8, dtype=jnp.float32)
    assert h.bits_equal(a, a + 0.0)
    assert not h.bits_equal(a, a.at[3].set(jnp.nextafter(a[3], jnp.inf)))
    assert not h.bits_equal(a, a.astype(jnp.int32))
    assert h.all_bits_equal((a, a), (a, a)) and not h.all_bits_equal((a,), (a, a))


def test_a_slow_call_is_its_own_warm_up_and_keeps_its_samples():
    calls = []

    def call():
        calls.append(time.perf_counter())
        time.sleep(h.SLOW_CALL_S * 1.2)
        return len(calls)

    runner = h.Runner(call=call, sync=lambda _: None, to_jax=None)
    keep = {}
    result = h.time_runner(runner, warmup=3, timed=10, target_sample_s=0.005, keep=keep)
    assert len(calls) == 11 and result["warmup"] == 1 and result["samples"] == 10
    assert result["reps_per_sample"] == 1 and keep["out"] == 11


class _DriftingDevice:
    """A fake device and host clock: a call takes its base time times a slowdown that grows with
    the clock (clocks, temperature, power drifting through a run); calls are synchronous."""

    def __init__(self, slowdown_per_s: float):
        self.now, self.rate, self.calls = 0.0, slowdown_per_s, []

    def perf_counter(self) -> float:
        return self.now

    def runner(self, name: str, base_s: float) -> h.Runner:
        def call():
            self.calls.append(name)
            self.now += base_s * (1.0 + self.rate * self.now)
            return name

        return h.Runner(call=call, sync=lambda _: None, to_jax=None)


def test_the_paired_ratio_holds_under_drift_where_the_ratio_of_medians_does_not(monkeypatch):
    device = _DriftingDevice(slowdown_per_s=1.0)  # 5% slower after 50 ms of calls
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=device.perf_counter))
    torch_side, ours = device.runner("torch", 1e-3), device.runner("ours", 0.95e-3)
    truth = 1.0 / 0.95  # torch's time over ours at the same device state
    how = dict(warmup=3, timed=10, target_sample_s=0.005)

    # Timed one after the other: the drift in between goes into the ratio of the medians.
    torch_alone = h.time_runner(torch_side, **how)
    ours_alone = h.time_runner(ours, **how)
    unpaired = torch_alone["median_ms"] / ours_alone["median_ms"]
    assert abs(unpaired - truth) > 0.04, unpaired

    # Paired, later still (the device slower yet): the ratio stays right.
    device.calls.clear()
    keep = {}
    mine, theirs = h.time_paired(torch_side, ours, **how, keep=keep)
    ratios = h.ratio_stats(theirs, mine)
    assert ratios["median"] == pytest.approx(truth, abs=0.01)
    assert ratios["p25"] <= ratios["median"] <= ratios["p75"]
    assert ratios["p75"] - ratios["p25"] < 0.01
    assert len(ratios["ratios"]) == 10 and keep["out"] == "ours"
    np.testing.assert_allclose(
        ratios["ratios"], np.array(theirs["samples_ms"]) / np.array(mine["samples_ms"]), rtol=1e-3
    )
    # Each side warmed up and calibrated as time_runner does, then the samples alternate.
    reps_t, reps_o = theirs["reps_per_sample"], mine["reps_per_sample"]
    assert reps_t > 1 and reps_o > 1 and mine["warmup"] == theirs["warmup"] == 5
    assert device.calls[:10] == ["torch"] * 5 + ["ours"] * 5
    assert device.calls[10:] == (["torch"] * reps_t + ["ours"] * reps_o) * 10
    # The medians of the same samples, taken apart, carry the drift between the two sides.
    assert mine["median_ms"] > ours_alone["median_ms"] > 0.95 * (1 + 0.05)


def test_the_budget_skips_extras_first_and_nothing_without_a_budget(monkeypatch):
    assert h.Budget(None).skip_reason() is None
    budget = h.Budget(100.0)
    monkeypatch.setattr(budget, "elapsed", lambda: 80.0)
    assert budget.skip_reason() is None
    assert budget.skip_reason(extra=True) == "skipped: time budget (80 s of 100)"
    monkeypatch.setattr(budget, "elapsed", lambda: 100.0)
    assert budget.skip_reason().startswith("skipped: time budget")


def _args(**kw):
    return types.SimpleNamespace(
        **{"repeats": 3, "time_failed": False, "warmup": 0, "timed": 2, "sample_s": 0.0, **kw}
    )


def _runner(fn):
    return lambda: h.jax_runner(fn, jnp.arange(16.0))


def test_measure_checks_repeats_and_times_what_passes():
    ok = lambda outs: {"ok": bool(outs[0][1] == 2.0)}  # noqa: E731
    rec, runner, first = h.measure(_runner(lambda x: x * 2), ok, names=("y",), args=_args())
    assert rec["status"] == "ok" and runner is not None and first[0][1] == 2.0
    assert rec["bitwise_repeatable"] == {
        "runs": 3, "identical": True, "outputs_differing": [], "last_timed_run_identical": True,
    }  # fmt: skip
    assert rec["timing"]["samples"] == 2
    # Paired with another runner: its timing beside, and the per-pair ratios.
    rec, _, _ = h.measure(_runner(lambda x: x * 2), ok, names=("y",), args=_args(),
                          paired_with=runner)  # fmt: skip
    assert len(rec["paired"]["base_over_this"]["ratios"]) == 2
    assert rec["paired"]["base_timing"]["samples"] == 2


def test_measure_does_not_time_a_failed_check_and_reports_what_does_not_build():
    bad = lambda outs: {"ok": False}  # noqa: E731
    rec, _, _ = h.measure(_runner(lambda x: x + 1), bad, names=("y",), args=_args())
    assert rec["status"] == "failed check (not timed)" and "timing" not in rec
    rec, _, _ = h.measure(_runner(lambda x: x + 1), bad, names=("y",), args=_args(time_failed=True))
    assert rec["status"].startswith("FAILED CHECK") and "timing" in rec

    def refused():
        raise h.NotAvailable("no GPU here")

    rec, runner, _ = h.measure(refused, bad, names=("y",), args=_args())
    assert rec == {"status": "not available: no GPU here"} and runner is None


def test_environment_names_the_command_versions_and_commit():
    env = h.environment("grouped_gemm", ["--smoke", "--out", "x y"], device=False)
    assert env["command"] == "python3 -m bench.grouped_gemm --smoke --out 'x y'"
    assert env["versions"]["jax"] == jax.__version__
    assert env["git_commit"] is None or len(env["git_commit"]) == 40
    assert "device" not in env
