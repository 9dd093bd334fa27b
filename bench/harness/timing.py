"""Built candidates and their timing: one `Runner` per candidate, timed alone (`time_runner`) or
in alternation with another (`time_paired`), and the optional time budget of a run (`Budget`).

A sample is `reps` back-to-back calls between two device synchronizations on the host clock,
divided by `reps`; `reps` makes a sample last at least `target_sample_s`, so that launch and
sync costs stay out of it. The same method serves JAX and torch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

SLOW_CALL_S = 0.05  # a first call this long is the whole warm-up (the checked runs warmed it)


class NotAvailable(Exception):
    """A candidate that cannot run here (not importable, no GPU, too much memory, ...)."""


@dataclasses.dataclass
class Runner:
    """A built candidate: call() launches it once (asynchronously) and returns its outputs."""

    call: Callable[[], Any]
    sync: Callable[[Any], Any]
    to_jax: Callable[[Any], tuple[jax.Array, ...]]
    compile_s: float = 0.0
    info: dict = dataclasses.field(default_factory=dict)


def as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def jax_memory_available() -> int | None:
    """Bytes the first device's allocator has left, where it says."""
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def jax_runner(fn: Callable, *args) -> Runner:
    """jit, lower and compile fn(*args); refuse (NotAvailable) what would not fit in memory."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    info: dict[str, Any] = {}
    try:
        analysis = compiled.memory_analysis()
        info = {
            "temp_bytes": int(analysis.temp_size_in_bytes),
            "output_bytes": int(analysis.output_size_in_bytes),
        }
    except Exception:  # not every backend reports it
        analysis = None
    available = jax_memory_available()
    if analysis is not None and available is not None:
        need = info["temp_bytes"] + info["output_bytes"]
        info["available_bytes"] = available
        if need > 0.9 * available:
            raise NotAvailable(
                f"XLA asks for {need / 2**30:.1f} GiB (temporaries + outputs), "
                f"{available / 2**30:.1f} GiB free for JAX"
            )
    return Runner(lambda: compiled(*args), jax.block_until_ready, as_tuple, compile_s, info)


def torch_runner(torch, fn: Callable[[], Any], *, on_gpu: bool) -> Runner:
    """fn runs torch work on the current stream; its first call (timed as compile_s) warms up.
    Outputs reach JAX through DLPack."""
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    t0 = time.perf_counter()
    fn()
    sync()
    compile_s = time.perf_counter() - t0

    def to_jax(out):
        sync()
        return tuple(jax.dlpack.from_dlpack(t.contiguous()) for t in as_tuple(out))

    return Runner(fn, lambda _out: sync(), to_jax, compile_s)


def time_fn(fn: Callable, *args, timed: int = 10, warmup: int = 1, keep: dict | None = None):
    """`time_runner` of a jitted fn(*args) (samples of at least 5 ms)."""
    runner = Runner(lambda: fn(*args), jax.block_until_ready, as_tuple)
    return time_runner(runner, warmup=warmup, timed=timed, target_sample_s=0.005, keep=keep)


def _warm_up(runner: Runner, *, warmup: int, target_sample_s: float) -> tuple[int, int]:
    """Warm-up and calibration: (reps per sample, calls made). A first call longer than
    SLOW_CALL_S is the whole warm-up, with one call a sample."""
    t0 = time.perf_counter()
    runner.sync(runner.call())
    single_s = time.perf_counter() - t0
    calls = 1
    if single_s <= SLOW_CALL_S:
        for _ in range(warmup):
            runner.sync(runner.call())
        t0 = time.perf_counter()
        runner.sync(runner.call())
        single_s = time.perf_counter() - t0
        calls += warmup + 1
    return max(1, min(50, round(target_sample_s / max(single_s, 1e-9)))), calls


def _sample(runner: Runner, reps: int) -> tuple[float, Any]:
    """One sample: `reps` back-to-back calls between two syncs, in ms a call; and the output."""
    t0 = time.perf_counter()
    for _ in range(reps):
        out = runner.call()
    runner.sync(out)
    return (time.perf_counter() - t0) / reps * 1e3, out


def _timing(samples: list[float], reps: int, warm_calls: int) -> dict:
    return {
        "median_ms": float(np.median(samples)),
        "min_ms": float(np.min(samples)),
        "max_ms": float(np.max(samples)),
        "reps_per_sample": reps,
        "samples": len(samples),
        "warmup": warm_calls,
        "samples_ms": [round(s, 5) for s in samples],
    }


def time_runner(
    runner: Runner, *, warmup: int, timed: int, target_sample_s: float, keep: dict | None = None
) -> dict:
    """The median (min, max) of `timed` samples after the warm-up. `keep["out"]`: the last
    output."""
    reps, warm_calls = _warm_up(runner, warmup=warmup, target_sample_s=target_sample_s)
    samples = []
    for _ in range(timed):
        ms, out = _sample(runner, reps)
        samples.append(ms)
    if keep is not None:
        keep["out"] = out
    return _timing(samples, reps, warm_calls)


def time_paired(
    base: Runner,
    runner: Runner,
    *,
    warmup: int,
    timed: int,
    target_sample_s: float,
    keep: dict | None = None,
) -> tuple[dict, dict]:
    """`runner` timed in alternation with `base`: each side warmed up and calibrated as
    time_runner does, then sample i of base, sample i of runner, sample i+1 of base, ... Drift
    of the device's clocks, temperature or power moves both sides of a pair alike, so the ratio
    of a pair carries less of it than the ratio of two medians timed seconds apart
    (`ratio_stats`). Returns (runner's timing, base's timing); `keep["out"]`: runner's last
    output."""
    base_reps, base_warm = _warm_up(base, warmup=warmup, target_sample_s=target_sample_s)
    reps, warm_calls = _warm_up(runner, warmup=warmup, target_sample_s=target_sample_s)
    base_samples, samples = [], []
    for _ in range(timed):
        base_samples.append(_sample(base, base_reps)[0])
        ms, out = _sample(runner, reps)
        samples.append(ms)
    if keep is not None:
        keep["out"] = out
    return _timing(samples, reps, warm_calls), _timing(base_samples, base_reps, base_warm)


def ratio_stats(numerator: dict, denominator: dict) -> dict:
    """The per-pair ratios numerator_i / denominator_i of two timings from `time_paired`: their
    median, 25th and 75th percentiles, min, max and every ratio."""
    ratios = np.asarray(numerator["samples_ms"]) / np.asarray(denominator["samples_ms"])
    return {
        "median": float(np.median(ratios)),
        "p25": float(np.percentile(ratios, 25)),
        "p75": float(np.percentile(ratios, 75)),
        "min": float(np.min(ratios)),
        "max": float(np.max(ratios)),
        "ratios": [round(float(r), 5) for r in ratios],
    }


class Budget:
    """Seconds since the run started against an optional budget: a step starts while the
    budget lasts; an `extra` step (not a target row) only while 70% of it lasts."""

    def __init__(self, budget_s: float | None):
        self.t0, self.budget_s = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def skip_reason(self, *, extra: bool = False) -> str | None:
        """None if a step may start now, else the status to record."""
        if self.budget_s is None or self.elapsed() < self.budget_s * (0.7 if extra else 1.0):
            return None
        return f"skipped: time budget ({self.elapsed():.0f} s of {self.budget_s:.0f})"
