"""The checks a candidate passes before it is timed: its outputs against a reference,
elementwise within a bound, and its runs against each other, bit for bit."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from bench.harness.timing import NotAvailable, Runner, ratio_stats, time_paired, time_runner

# The references compile without XLA's GEMM autotuner, which times every new f32 dot shape
# (7-14 s a reference on an H200 with it, ~1 s without). It only picks among algorithms for the
# same products. Per executable (`jax.jit(..., compiler_options=...)`), not process-wide.
REFERENCE_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


@jax.jit
def _errors(out, ref, rtol, scale_by_max):
    o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
    err = jnp.abs(o - r)
    rms = jnp.sqrt(jnp.mean(r * r)) + jnp.float32(1e-30)
    scale = jnp.where(scale_by_max, jnp.max(jnp.abs(r)) + jnp.float32(1e-30), rms)
    return {
        "finite": jnp.all(jnp.isfinite(o)),
        "max_excess": jnp.max(err - rtol * jnp.abs(r)) / scale,
        "max_err_over_rms": jnp.max(err) / rms,
        "rel_fro": jnp.linalg.norm((o - r).ravel()) / (jnp.linalg.norm(r.ravel()) + 1e-30),
    }


def compare(out: jax.Array, ref: jax.Array, *, rtol: float, atol: float, scale: str) -> dict:
    """Elementwise check of out against ref (same shape): finite and |out - ref| <= rtol |ref|
    + atol s, s the rms (scale "rms") or the largest magnitude (scale "max") of ref.
    `max_excess` is the largest |out - ref| - rtol |ref| in units of s (passes: <= atol)."""
    if out.shape != ref.shape:
        return {"ok": False, "why": f"shape {out.shape} != reference {ref.shape}"}
    stats = {k: float(v) for k, v in _errors(out, ref, rtol, scale == "max").items()}
    stats["ok"] = bool(stats["finite"]) and stats["max_excess"] <= atol
    return stats


def _as_bits(a: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.itemsize])


@jax.jit
def _bits_equal(a, b):
    return jnp.array_equal(_as_bits(a), _as_bits(b))


def bits_equal(a: jax.Array, b: jax.Array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(_bits_equal(a, b))


def all_bits_equal(a: Sequence[jax.Array], b: Sequence[jax.Array]) -> bool:
    return len(a) == len(b) and all(bits_equal(x, y) for x, y in zip(a, b, strict=True))


def repeat_bitwise(runner: Runner, first: tuple, repeats: int, names: Sequence[str]) -> dict:
    """`repeats - 1` more runs compared with the first, output by output."""
    differing: set[str] = set()
    for _ in range(repeats - 1):
        again = runner.to_jax(runner.call())
        differing |= {
            n for n, a, b in zip(names, first, again, strict=True) if not bits_equal(a, b)
        }
        del again
    return {
        "runs": repeats,
        "identical": not differing,
        "outputs_differing": [n for n in names if n in differing],
    }


def failed(rec: dict, prefix: str, e: Exception) -> None:
    """Records an exception as the candidate's status, with the end of its traceback."""
    rec["status"] = f"{prefix}: {type(e).__name__}: {e}"[:1500]
    rec["traceback"] = traceback.format_exc()[-3000:]


def measure(
    build: Callable[[], Runner],
    check: Callable[[tuple], dict],
    *,
    names: Sequence[str],
    args,
    paired_with: Runner | None = None,
) -> tuple[dict, Runner | None, tuple]:
    """One candidate: build it, run it once and `check` its outputs, run it `args.repeats - 1`
    more times compared bitwise, then (if the check passed, or with `args.time_failed`) time
    it, alone or in alternation with `paired_with` (`time_paired`: the record's "paired" holds
    the other side's timing), and compare its last timed output with the first bitwise.
    Returns the record, the runner (None if it did not build) and the first outputs."""
    rec: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        runner = build()
    except NotAvailable as e:
        rec["status"] = f"not available: {e}"
        return rec, None, ()
    except Exception as e:  # a candidate that raises is reported, not fatal
        failed(rec, "not available", e)
        return rec, None, ()
    rec["compile_s"] = round(runner.compile_s, 3)
    rec.update(runner.info)
    first: tuple = ()
    try:
        first = runner.to_jax(runner.call())
        rec["check"] = check(first)
        rec["bitwise_repeatable"] = repeat_bitwise(runner, first, args.repeats, names)
        if not rec["check"]["ok"] and not args.time_failed:
            rec["status"] = "failed check (not timed)"
        else:
            keep: dict[str, Any] = {}
            how = dict(warmup=args.warmup, timed=args.timed, target_sample_s=args.sample_s)
            if paired_with is None:
                rec["timing"] = time_runner(runner, **how, keep=keep)
            else:
                rec["timing"], base = time_paired(paired_with, runner, **how, keep=keep)
                ratios = ratio_stats(base, rec["timing"])
                rec["paired"] = {"base_timing": base, "base_over_this": ratios}
            last = runner.to_jax(keep.pop("out"))
            rec["bitwise_repeatable"]["last_timed_run_identical"] = all_bits_equal(first, last)
            del last
            ok = rec["check"]["ok"]
            rec["status"] = "ok" if ok else "FAILED CHECK (timed anyway: --time-failed)"
    except Exception as e:
        failed(rec, "error", e)
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    return rec, runner, first
