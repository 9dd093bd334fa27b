"""Grouped-GEMM benchmark (issue 4): our Mosaic GPU kernels against torch._grouped_mm, tokamax's
mosaic ragged_dot, the jax example Mosaic GPU kernels and jax.lax.ragged_dot, in one process.

The one device command (repository root, device call with `carry: [".whl"]`, timeout 600 s):

    bash bench/grouped_gemm_h200.sh

It installs the carried tokamax wheels and runs this script, writing the results to $OUT.
Locally, on CPU (tiny shapes, our kernels in GPU interpret mode, GPU-only baselines "not
available"), and the full run's time plan without running it:

    PYTHONPATH=. python -m bench.grouped_gemm_h200 --smoke --out /tmp/gg
    PYTHONPATH=. python -m bench.grouped_gemm_h200 --plan

What it does, per shape (DESIGN.md's five plus qwen3 gate_up under Zipf routing) and product
(forward, dgrad, wgrad, backward = dgrad + wgrad as autograd runs it, fused SwiGLU):
  1. bf16 random inputs on the device (x ~ N(0, 1), w ~ N(0, 1/K), dout ~ N(0, 1)); torch
     sees the same buffers through DLPack.
  2. Each candidate runs once and is checked: against torch's result (all elements) and against
     `pallas_kernels/grouped_matmul/reference.py` in f32 on a few groups (first/last rows of the
     first, middle, last and largest groups; whole groups for the weight gradient). Pass:
     finite, and |out - ref| <= 2^-6 * (|ref| + rms(ref)) elementwise.
  3. Two more runs on the same inputs; the three outputs are compared bitwise (and the last
     timed run's output with the first).
  4. Timing: warm-up, then >= 10 timed samples; a sample is `reps` back-to-back calls between
     two device synchronizations (host clock), divided by `reps` (reps makes a sample >= ~5 ms
     so launch and sync overhead stay out; the same method for JAX and torch). Median, min, max.
     Our kernels (--paired, the default) are timed in alternation with torch instead (sample i
     of torch, then sample i of ours, ...: `time_paired`), and also get the median of the
     per-pair ratios torch_i / ours_i with its 25th-75th percentile: drift of the device over
     the run moves both sides of a pair alike. The other candidates are timed alone.
  TFLOP/s counts 2*M*K*N (M = routed rows; backward counts twice that); ratio = torch time /
  candidate time (> 1: faster than torch).
A candidate that cannot be imported or built is reported as "not available: <reason>"; one that
fails its check is not timed. Time: the run is planned to fit one device call (`Planner`: each
step starts only if its estimate and those of all higher-priority steps still to come fit;
what does not fit is recorded as skipped), and a watchdog writes the results and exits if the
run outlives its hard limit. Results: grouped_gemm_h200.{json,md} in --out, rewritten after
every candidate so a run cut short still leaves its numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import inspect
import json
import logging
import math
import os
import pathlib
import platform
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Sequence
from typing import Any

# torch shares the GPU with JAX in this process: JAX must not take 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.80")

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.grouped_matmul import reference

# The budget's start of a script run without --started-at (imports included). A call of
# main() from other code (the tests) starts its budget at the call instead: this module may
# have been imported long before, and the watchdog would end that process at once.
PROCESS_START = time.time()
ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICE_COMMAND = "bash bench/grouped_gemm_h200.sh"
ZIPF_EXPONENT = 1.2
SEED = 0
TOL = 2.0**-6  # bf16 outputs: relative to |ref| plus the output's rms
PRODUCTS = ("forward", "dgrad", "wgrad", "backward", "swiglu")
FAMILIES = ("torch", "ours", "tokamax", "jax_example", "xla")
# jax example kernel tiles: DESIGN.md's "128x128x64, 4 stages" (grid_block_n not stated there).
JAX_EXAMPLE_TILES = dict(
    block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1
)


# ---------------------------------------------------------------------------------------------
# Shapes and routing


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """One grouped GEMM: M routed rows of width K, G groups of [K, N] weights."""

    name: str
    m: int
    k: int
    n: int
    g: int
    routing: str  # "uniform" (multinomial of M rows over G equal groups) or "zipf"
    gate_up: bool  # N holds gate and up side by side: also time the fused SwiGLU (F = N / 2)
    design_tflops: dict[str, float]  # DESIGN.md's measured forward TFLOP/s, by candidate name


SHAPES: tuple[Shape, ...] = (
    Shape(
        name="qwen3_gate_up",
        m=131072, k=2048, n=1536, g=128, routing="uniform", gate_up=True,
        design_tflops={"xla ragged_dot": 4.9, "tokamax mosaic": 280, "jax example mgpu": 298,
                       "torch._grouped_mm": 655},
    ),
    Shape(
        name="qwen3_down",
        m=131072, k=768, n=2048, g=128, routing="uniform", gate_up=False,
        design_tflops={"xla ragged_dot": 5.9, "tokamax mosaic": 261, "jax example mgpu": 217,
                       "torch._grouped_mm": 556},
    ),
    Shape(
        name="mixtral_gate_up",
        m=16384, k=4096, n=28672, g=8, routing="uniform", gate_up=True,
        design_tflops={"xla ragged_dot": 96, "tokamax mosaic": 261, "jax example mgpu": 455,
                       "torch._grouped_mm": 637},
    ),
    Shape(
        name="dsv3_ep8_gate_up",
        m=32768, k=7168, n=4096, g=32, routing="uniform", gate_up=True,
        design_tflops={"xla ragged_dot": 24, "tokamax mosaic": 288, "jax example mgpu": 421,
                       "torch._grouped_mm": 618},
    ),
    Shape(
        name="dsv3_ep8_down",
        m=32768, k=2048, n=7168, g=32, routing="uniform", gate_up=False,
        design_tflops={"xla ragged_dot": 25, "tokamax mosaic": 284, "jax example mgpu": 371,
                       "torch._grouped_mm": 561},
    ),
    Shape(
        name=f"qwen3_gate_up_zipf{ZIPF_EXPONENT}",
        m=131072, k=2048, n=1536, g=128, routing="zipf", gate_up=True, design_tflops={},
    ),
)  # fmt: skip

SMOKE_SHAPES: tuple[Shape, ...] = (
    Shape(name="smoke_uniform", m=256, k=256, n=256, g=4, routing="uniform", gate_up=True,
          design_tflops={}),
    Shape(name=f"smoke_zipf{ZIPF_EXPONENT}", m=192, k=256, n=256, g=6, routing="zipf",
          gate_up=False, design_tflops={}),
)  # fmt: skip


def uniform_group_sizes(m: int, g: int, *, seed: int) -> np.ndarray:
    """int32 [G]: a multinomial draw of m rows over g equally likely groups (sums to m)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(m, np.full(g, 1.0 / g)).astype(np.int32)


def zipf_group_sizes(m: int, g: int, *, exponent: float, seed: int) -> np.ndarray:
    """int32 [G]: sizes proportional to 1 / rank**exponent, rounded (largest remainder) to sum
    to m, then shuffled over the groups."""
    weights = np.arange(1, g + 1, dtype=np.float64) ** -exponent
    exact = m * weights / weights.sum()
    sizes = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - sizes), kind="stable")
    sizes[order[: m - int(sizes.sum())]] += 1
    return np.random.default_rng(seed).permutation(sizes).astype(np.int32)


def group_sizes_for(shape: Shape) -> np.ndarray:
    if shape.routing == "zipf":
        return zipf_group_sizes(shape.m, shape.g, exponent=ZIPF_EXPONENT, seed=SEED)
    return uniform_group_sizes(shape.m, shape.g, seed=SEED)


# ---------------------------------------------------------------------------------------------
# Checks


class NotAvailable(Exception):
    """A candidate that cannot run here (not importable, no GPU, too much memory, ...)."""


@jax.jit
def _errors(out, ref):
    o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
    scale = jnp.sqrt(jnp.mean(r * r)) + jnp.float32(1e-30)
    err = jnp.abs(o - r)
    return {
        "finite": jnp.all(jnp.isfinite(o)),
        "max_excess": jnp.max(err - TOL * jnp.abs(r)) / scale,  # pass: <= TOL
        "max_err_over_rms": jnp.max(err) / scale,
        "rel_fro": jnp.linalg.norm((o - r).ravel()) / (jnp.linalg.norm(r.ravel()) + 1e-30),
    }


def compare(out: jax.Array, ref: jax.Array) -> dict:
    """Elementwise check of out against ref (same shape): finite and within TOL."""
    if out.shape != ref.shape:
        return {"ok": False, "why": f"shape {out.shape} != reference {ref.shape}"}
    stats = {key: float(value) for key, value in _errors(out, ref).items()}
    stats["ok"] = bool(stats["finite"]) and stats["max_excess"] <= TOL
    return stats


def _as_bits(a: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.itemsize])


@jax.jit
def _bits_equal(a, b):
    return jnp.array_equal(_as_bits(a), _as_bits(b))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Subset:
    """The reference on a few groups: rows (for [M, *] outputs) or groups (for [G, K, N])."""

    index: np.ndarray  # rows of the output, or groups of the output
    axis_is_group: bool
    ref: jax.Array  # f32, the same rows / groups of the reference


def pick_groups(sizes: np.ndarray) -> np.ndarray:
    """The first, middle, last and largest non-empty groups."""
    nonempty = np.flatnonzero(sizes)
    picks = {nonempty[0], nonempty[len(nonempty) // 2], nonempty[-1], int(np.argmax(sizes))}
    return np.array(sorted(int(p) for p in picks), dtype=np.int64)


def group_rows(sizes: np.ndarray, groups: np.ndarray, *, cap: int | None) -> tuple[np.ndarray, ...]:
    """Rows of `groups` (all, or the first and last `cap` of each) and their count per group."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rows, counts = [], []
    for g in groups:
        start, size = int(starts[g]), int(sizes[g])
        r = np.arange(start, start + size)
        if cap is not None and size > 2 * cap:
            r = np.concatenate([r[:cap], r[-cap:]])
        rows.append(r)
        counts.append(len(r))
    return np.concatenate(rows).astype(np.int64), np.array(counts, dtype=np.int32)


# ---------------------------------------------------------------------------------------------
# Candidates


@dataclasses.dataclass
class Runner:
    """A built candidate: call() launches it once (asynchronously) and returns its outputs."""

    call: Callable[[], Any]
    sync: Callable[[Any], Any]
    to_jax: Callable[[Any], tuple[jax.Array, ...]]
    compile_s: float
    info: dict


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    family: str  # one of FAMILIES
    build: Callable[[], Runner]
    extra: bool = False  # not a target row: skipped first when time runs short
    config: str | Callable[[], str] = ""  # a callable is described when the candidate runs
    config_source: str = ""  # where `config` came from (ours: defaults table or a sweep)


def _as_tuple(out) -> tuple[jax.Array, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _xla_dense_bytes(s: Shape, product: str) -> int:
    """Bytes of the dense per-group operands XLA:GPU builds for the ragged-contracting dot."""
    return s.g * s.m * (s.k + s.n + (s.k if product == "backward" else 0)) * 2


def _jax_memory_available() -> int | None:
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
    available = _jax_memory_available()
    if analysis is not None and available is not None:
        need = info["temp_bytes"] + info["output_bytes"]
        info["available_bytes"] = available
        if need > 0.9 * available:
            raise NotAvailable(
                f"XLA asks for {need / 2**30:.1f} GiB (temporaries + outputs), "
                f"{available / 2**30:.1f} GiB free for JAX"
            )
    return Runner(
        call=lambda: compiled(*args),
        sync=jax.block_until_ready,
        to_jax=_as_tuple,
        compile_s=compile_s,
        info=info,
    )


def torch_runner(torch_mod, fn: Callable[[], Any], *, on_gpu: bool) -> Runner:
    """fn runs torch work on the current stream; its first call (timed as compile_s) warms up."""
    sync = torch_mod.cuda.synchronize if on_gpu else (lambda: None)
    t0 = time.perf_counter()
    fn()
    sync()
    compile_s = time.perf_counter() - t0

    def to_jax(out):
        sync()
        return tuple(jax.dlpack.from_dlpack(t.contiguous()) for t in _as_tuple(out))

    return Runner(call=fn, sync=lambda _out: sync(), to_jax=to_jax, compile_s=compile_s, info={})


def _import_tokamax():
    """tokamax, with an empty stand-in for its optional `xprof` import (benchmarking only)."""
    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
        sys.modules.setdefault(name, types.ModuleType(name))
    tools = sys.modules["xprof.cli.tools"]
    if not hasattr(tools, "get_kernel_stats_tool"):
        tools.get_kernel_stats_tool = None
    import tokamax  # optional, absent on CPU machines
    from tokamax._src.ops.ragged_dot import base

    # One "autotuning cache miss" warning per call (no H200 entries: heuristics configs).
    logging.getLogger("absl").setLevel(logging.ERROR)
    return tokamax, base


def _kwargs_accepted(fn: Callable, **kwargs) -> dict:
    params = inspect.signature(fn).parameters
    return {key: value for key, value in kwargs.items() if key in params}


@dataclasses.dataclass
class Problem:
    """One shape's inputs (JAX on the device, torch views of the same buffers)."""

    shape: Shape
    sizes: np.ndarray
    x: jax.Array  # [M, K] bf16
    w: jax.Array  # [G, K, N] bf16
    dout: jax.Array  # [M, N] bf16
    gs: jax.Array  # [G] int32
    w_gate: jax.Array | None  # [G, K, N/2] (gate_up shapes)
    w_up: jax.Array | None
    torch: Any = None  # the torch module, or None
    t: dict = dataclasses.field(default_factory=dict)  # torch views
    subsets: dict = dataclasses.field(default_factory=dict)  # reference.py parts, by name

    @classmethod
    def placeholder(cls, shape: Shape, torch_mod=None) -> Problem:
        """No data: enough to list the candidates (their builds read the data when called)."""
        return cls(shape, group_sizes_for(shape), *(None,) * 6, torch=torch_mod)


class Bench:
    """Builds the candidates of each product for one problem."""

    def __init__(self, args, problem: Problem):
        self.args, self.p = args, problem
        self.interpret = args.smoke and jax.default_backend() != "gpu"
        self.on_gpu = jax.default_backend() == "gpu"

    # -- torch ------------------------------------------------------------------------------

    def _torch_runner(self, fn: Callable[[], Any]) -> Runner:
        if self.p.torch is None:
            raise NotAvailable(self.args.torch_missing)
        return torch_runner(self.p.torch, fn, on_gpu=self.on_gpu)

    def torch_candidates(self, product: str) -> list[Candidate]:
        p, t = self.p, self.p.t
        gmm = getattr(self.p.torch, "_grouped_mm", None) if self.p.torch else None

        def build(fn):
            return lambda: self._torch_runner(fn)

        if product == "forward":
            fn = lambda: gmm(t["x"], t["w"], offs=t["offs"])  # noqa: E731
        elif product == "dgrad":
            fn = lambda: gmm(t["dout"], t["w"].transpose(-2, -1), offs=t["offs"])  # noqa: E731
        elif product == "wgrad":
            fn = lambda: gmm(t["x"].t(), t["dout"], offs=t["offs"])  # noqa: E731
        elif product == "backward":

            def backward_build():
                torch = p.torch
                if torch is None:
                    raise NotAvailable(self.args.torch_missing)
                x = t["x"].detach().requires_grad_(True)
                w = t["w"].detach().requires_grad_(True)
                with torch.enable_grad():
                    out = gmm(x, w, offs=t["offs"])
                return self._torch_runner(
                    lambda: torch.autograd.grad(out, (x, w), t["dout"], retain_graph=True)
                )

            return [
                Candidate(
                    "torch autograd backward",
                    "torch",
                    backward_build,
                    config="autograd.grad of torch._grouped_mm (retain_graph)",
                )
            ]
        elif product == "swiglu":

            def fn():
                gate = gmm(t["x"], t["w_gate"], offs=t["offs"])
                up = gmm(t["x"], t["w_up"], offs=t["offs"])
                return p.torch.nn.functional.silu(gate) * up

            return [
                Candidate(
                    "torch 2x _grouped_mm + silu*up",
                    "torch",
                    build(fn),
                    config="two grouped mms, then silu(gate) * up in bf16",
                )
            ]
        layouts = {
            "forward": "x [M,K] row-major, w [G,K,N] row-major",
            "dgrad": "dout [M,N], w.transpose(-2,-1) (a column-major view, no copy)",
            "wgrad": "x.t() (a column-major view) x dout [M,N] -> [G,K,N]",
        }
        return [Candidate("torch._grouped_mm", "torch", build(fn), config=layouts[product])]

    # -- ours -------------------------------------------------------------------------------

    def _ours(self, module: str):
        try:
            return importlib.import_module(f"pallas_kernels.grouped_matmul.{module}")
        except Exception as e:  # any import failure means "not available"
            raise NotAvailable(f"import pallas_kernels.grouped_matmul.{module}: {e!r}") from e

    def _ours_config(self, product: str, *, use_sweep: bool = True) -> tuple[Any, str, str]:
        """(config to pass, its description, where it came from) of our kernel for `product`:
        the best passing config of a --configs sweep for this (product, shape), else None (the
        kernel's defaults table)."""
        shape = self.p.shape
        picked = self.args.sweep_configs.get((product, shape.name)) if use_sweep else None
        if picked is not None:
            source = (
                f"sweep {self.args.configs}: best passing run '{picked['label']}' "
                f"({picked['median_ms']:.3f} ms there)"
            )
            return picked["config"], repr(picked["config"]), source
        try:
            if product == "wgrad":
                config = self._ours("mosaic_gpu_wgrad").default_config(shape.k, shape.n)
            else:
                mod = self._ours("mosaic_gpu")
                n = {"forward": shape.n, "dgrad": shape.k, "swiglu": shape.n // 2}[product]
                config = mod.default_config(
                    n=n,
                    transpose_rhs=product == "dgrad",
                    swiglu=product == "swiglu",
                    interpret=self.interpret,
                )
            return None, repr(config), "defaults table (config=None)"
        except Exception as e:  # the record says what it could not tell
            return None, f"could not describe it: {e!r}"[:300], "defaults table (config=None)"

    def ours_candidates(self, product: str) -> list[Candidate]:
        p, interp = self.p, {"interpret": True} if self.interpret else {}

        def gmm_build(x, w, **kw):
            def build():
                mod = self._ours("mosaic_gpu")
                fn = functools.partial(mod.gmm, **kw, **interp)
                return jax_runner(fn, x, w, p.gs)

            return build

        if product in ("forward", "dgrad", "wgrad", "swiglu"):
            config, described, source = self._ours_config(product)
            picked = {"config": config} if config is not None else {}
        if product == "forward":
            cands = [
                Candidate(
                    "ours mosaic_gpu.gmm",
                    "ours",
                    gmm_build(p.x, p.w, **picked),
                    config=described,
                    config_source=source,
                ),
            ]

            def triton_build():
                mod = self._ours("triton")
                fn = functools.partial(mod.gmm, **_kwargs_accepted(mod.gmm, **interp))
                return jax_runner(fn, p.x, p.w, p.gs)

            cands.append(
                Candidate(
                    "ours triton.gmm",
                    "ours",
                    triton_build,
                    extra=True,
                    config=lambda: repr(self._ours("triton").TritonTileConfig()),
                    config_source="TritonTileConfig's defaults (config=None)",
                )
            )
            return cands
        if product == "dgrad":
            return [
                Candidate(
                    "ours mosaic_gpu.gmm(transpose_rhs)",
                    "ours",
                    gmm_build(p.dout, p.w, transpose_rhs=True, **picked),
                    config=described,
                    config_source=source,
                ),
            ]
        if product == "wgrad":

            def tgmm_build(out_dtype, **kw):
                def build():
                    mod = self._ours("mosaic_gpu_wgrad")
                    fn = functools.partial(mod.tgmm, out_dtype=out_dtype, **kw, **interp)
                    return jax_runner(fn, p.x, p.dout, p.gs)

                return build

            _, default_described, _ = self._ours_config("wgrad", use_sweep=False)
            return [
                Candidate(
                    "ours tgmm (bf16 out)",
                    "ours",
                    tgmm_build(jnp.bfloat16, **picked),
                    config=described,
                    config_source=source,
                ),
                Candidate(
                    "ours tgmm (f32 out)",
                    "ours",
                    tgmm_build(jnp.float32),
                    extra=True,
                    config=default_described,
                    config_source="defaults table (config=None; a sweep's bf16-out config is "
                    "not applied to the f32 output)",
                ),
            ]
        if product == "backward":

            def ops_build():
                ops = self._ours("ops")
                if not hasattr(ops, "gmm"):
                    raise NotAvailable("pallas_kernels.grouped_matmul.ops has no gmm")
                fn = functools.partial(ops.gmm, **_kwargs_accepted(ops.gmm, **interp))
                return self._vjp_runner(lambda a, b: fn(a, b, p.gs))

            return [
                Candidate(
                    "ours ops.gmm backward (custom_vjp)",
                    "ours",
                    ops_build,
                    config=lambda: (
                        f"dgrad: {self._ours_config('dgrad', use_sweep=False)[1]}; "
                        f"wgrad: {self._ours_config('wgrad', use_sweep=False)[1]}"
                    ),
                    config_source="defaults table (ops.gmm takes no config)",
                )
            ]
        if product == "swiglu":

            def swiglu_build():
                mod = self._ours("mosaic_gpu")
                fn = functools.partial(mod.gmm_swiglu, **picked, **interp)
                return jax_runner(fn, p.x, p.w_gate, p.w_up, p.gs)

            return [
                Candidate(
                    "ours mosaic_gpu.gmm_swiglu",
                    "ours",
                    swiglu_build,
                    config=described,
                    config_source=source,
                )
            ]
        raise ValueError(product)

    # -- JAX baselines ------------------------------------------------------------------------

    def _vjp_runner(self, f: Callable) -> Runner:
        """The backward alone: jax.vjp once (residuals), then the jitted pullback of dout."""
        _, pullback = jax.vjp(f, self.p.x, self.p.w)
        return jax_runner(lambda pb, d: pb(d), pullback, self.p.dout)

    def tokamax_candidates(self, product: str) -> list[Candidate]:
        p = self.p

        def need_gpu():
            if not self.on_gpu:
                raise NotAvailable(f"needs a CUDA GPU (JAX backend is {jax.default_backend()})")
            try:
                return _import_tokamax()
            except Exception as e:
                raise NotAvailable(f"import tokamax: {e!r}") from e

        def dims_build(lhs, rhs, dims_name):
            def build():
                tokamax, base = need_gpu()
                dims = getattr(base, dims_name)
                fn = functools.partial(
                    tokamax.ragged_dot_general,
                    ragged_dot_dimension_numbers=dims,
                    preferred_element_type=jnp.bfloat16,
                    implementation="mosaic",
                )
                return jax_runner(lambda a, b, g: fn(a, b, g), lhs, rhs, p.gs)

            return build

        config = lambda: self.tokamax_config  # noqa: E731 (described when it runs)
        if product == "forward":
            build = dims_build(p.x, p.w, "DEFAULT_RAGGED_DOT_DIM_NUMS")
            return [Candidate("tokamax mosaic", "tokamax", build, config=config)]
        if product == "dgrad":
            build = dims_build(p.dout, p.w, "TRANS_RHS_RAGGED_DOT_DIM_NUMS")
            return [Candidate("tokamax mosaic", "tokamax", build, config=config)]
        if product == "wgrad":
            build = dims_build(p.x, p.dout, "RAGGED_CONTRACTING_DOT_DIM_NUMS")
            return [Candidate("tokamax mosaic", "tokamax", build, config=config)]
        if product == "backward":

            def vjp_build():
                tokamax, _ = need_gpu()
                return self._vjp_runner(
                    lambda a, b: tokamax.ragged_dot(a, b, p.gs, implementation="mosaic")
                )

            return [Candidate("tokamax mosaic VJP", "tokamax", vjp_build, config=config)]
        if product == "swiglu":

            def swiglu_build():
                tokamax, _ = need_gpu()

                def fn(x, wg, wu, gs):
                    gate = tokamax.ragged_dot(x, wg, gs, implementation="mosaic")
                    up = tokamax.ragged_dot(x, wu, gs, implementation="mosaic")
                    return jax.nn.silu(gate) * up

                return jax_runner(fn, p.x, p.w_gate, p.w_up, p.gs)

            return [
                Candidate(
                    "tokamax 2x mosaic + silu*up",
                    "tokamax",
                    swiglu_build,
                    extra=True,
                    config=config,
                )
            ]
        raise ValueError(product)

    @functools.cached_property
    def tokamax_config(self) -> str:
        if not self.on_gpu:
            return ""
        try:
            _import_tokamax()
            from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu

            op = pallas_mosaic_gpu.PallasMosaicGpuRaggedDot()
            bound = op.bind(self.p.x, self.p.w, group_sizes=self.p.gs)
            return f"default_config (heuristics unless cached): {bound.default_config!r}"
        except Exception as e:
            return f"could not describe: {e!r}"[:300]

    def jax_example_candidates(self, product: str) -> list[Candidate]:
        p, tiles = self.p, JAX_EXAMPLE_TILES
        config = " ".join(f"{key}={value}" for key, value in tiles.items())

        def build(module, fn_name, lhs, rhs, **kw):
            def b():
                if not self.on_gpu:
                    raise NotAvailable(f"needs a CUDA GPU (JAX backend is {jax.default_backend()})")
                mod = importlib.import_module(f"jax.experimental.pallas.ops.gpu.{module}")
                fn = functools.partial(getattr(mod, fn_name), **tiles, **kw)
                return jax_runner(lambda a, c, g: fn(a, c, group_sizes=g), lhs, rhs, p.gs)

            return b

        name = "jax example mgpu"
        if product == "forward":
            return [
                Candidate(
                    name,
                    "jax_example",
                    build("ragged_dot_mgpu", "ragged_dot", p.x, p.w),
                    config=config,
                )
            ]
        if product == "dgrad":
            return [
                Candidate(
                    name,
                    "jax_example",
                    build("ragged_dot_mgpu", "ragged_dot", p.dout, p.w, transpose_rhs=True),
                    extra=True,
                    config=config,
                )
            ]
        if product == "wgrad":
            return [
                Candidate(
                    name + " (transposed_ragged_dot)",
                    "jax_example",
                    build("transposed_ragged_dot_mgpu", "transposed_ragged_dot", p.x, p.dout),
                    extra=True,
                    config=config,
                )
            ]
        return []

    def xla_candidates(self, product: str) -> list[Candidate]:
        p = self.p
        if product not in self.args.xla_products:
            return []
        dims = {
            "forward": ((p.x, p.w), (([1], [1]), ([], [])), [0]),
            "dgrad": ((p.dout, p.w), (([1], [2]), ([], [])), [0]),
            "wgrad": ((p.x, p.dout), (([0], [0]), ([], [])), []),
        }
        if product in dims:
            (lhs, rhs), dot_dims, rhs_group = dims[product]
            numbers = jax.lax.RaggedDotDimensionNumbers(
                dot_dimension_numbers=dot_dims,
                lhs_ragged_dimensions=[0],
                rhs_group_dimensions=rhs_group,
            )

            def build():
                if product == "wgrad":
                    self._xla_dense_guard(product)
                fn = functools.partial(
                    jax.lax.ragged_dot_general, ragged_dot_dimension_numbers=numbers
                )
                return jax_runner(lambda a, b, g: fn(a, b, g), lhs, rhs, p.gs)

            return [Candidate("xla ragged_dot", "xla", build, config="jax.lax.ragged_dot_general")]
        if product == "backward":

            def vjp_build():
                self._xla_dense_guard(product)
                return self._vjp_runner(lambda a, b: jax.lax.ragged_dot(a, b, p.gs))

            return [Candidate("xla ragged_dot VJP", "xla", vjp_build)]
        return []

    def _xla_dense_guard(self, product: str) -> None:
        """XLA:GPU lowers the ragged-contracting dot (the weight gradient) through dense
        per-group operands, bf16[G, M, K] and bf16[G, M, N] (its VJP adds a bf16[M, G, K]
        transpose): seen in the HLO of its out-of-memory failures on the H200 (2026-11-30).
        Refuse up front what cannot fit rather than spend compile and autotuning time."""
        need = _xla_dense_bytes(self.p.shape, product)
        available = _jax_memory_available()
        if available is not None and need > available:
            raise NotAvailable(
                f"XLA's {product} builds dense per-group operands of {need / 2**30:.0f} GiB "
                f"(G*M*(K+N{'+K' if product == 'backward' else ''}) bf16), "
                f"{available / 2**30:.0f} GiB free for JAX (it ran out of memory in XLA's "
                "autotuner at the qwen3 shapes on 2026-11-30)"
            )

    def candidates(self, product: str) -> list[Candidate]:
        by_family = {
            "torch": self.torch_candidates,
            "ours": self.ours_candidates,
            "tokamax": self.tokamax_candidates,
            "jax_example": self.jax_example_candidates,
            "xla": self.xla_candidates,  # last: the slowest, and it grows JAX's memory pool
        }
        out = []
        for family in FAMILIES:
            if family in self.args.families:
                out += by_family[family](product)
        return out


# ---------------------------------------------------------------------------------------------
# References


# The references compile without XLA's GEMM autotuner. On the H200 every new reference part cost
# 7-14 s before its torch row (2026-11-30 sweep log), except the two swiglu pairs whose f32 dot
# shapes an earlier pair had already compiled (~1 s): the autotuner timing each new f32 dot
# shape, most likely, about 200 s over a full run. It only picks among algorithms for the same
# products. Per-executable options, not process-wide flags.
REFERENCE_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}
_ref_jit = functools.partial(jax.jit, compiler_options=REFERENCE_COMPILER_OPTIONS)
_ref_gmm = _ref_jit(reference.gmm, static_argnames="transpose_rhs")
_ref_tgmm = _ref_jit(reference.tgmm)
_ref_swiglu = _ref_jit(reference.gmm_swiglu)
_ref_ragged_dot = _ref_jit(
    functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32)
)


def full_reference(p: Problem, product: str) -> tuple[jax.Array, ...]:
    """All elements of the expected result without torch: XLA ragged_dot (bf16 products, f32
    accumulation) and reference.tgmm in f32."""
    rd = _ref_ragged_dot
    if product == "forward":
        return (rd(p.x, p.w, p.gs),)
    if product == "dgrad":
        return (rd(p.dout, jnp.swapaxes(p.w, 1, 2), p.gs),)
    if product == "wgrad":
        return (_ref_tgmm(p.x, p.dout, p.gs),)
    if product == "backward":
        return (rd(p.dout, jnp.swapaxes(p.w, 1, 2), p.gs), _ref_tgmm(p.x, p.dout, p.gs))
    if product == "swiglu":
        return (jax.nn.silu(rd(p.x, p.w_gate, p.gs)) * rd(p.x, p.w_up, p.gs),)
    raise ValueError(product)


SUBSET_PARTS = {
    "forward": ("forward",),
    "dgrad": ("dgrad",),
    "wgrad": ("wgrad",),
    "backward": ("dgrad", "wgrad"),
    "swiglu": ("swiglu",),
}


def subset_reference(p: Problem, product: str, *, cap: int) -> tuple[Subset, ...]:
    """reference.py in f32 on a few groups (rows of them, or whole groups for wgrad); each
    part computed once per problem (backward reuses dgrad's and wgrad's)."""
    groups = pick_groups(p.sizes)
    g = jnp.asarray(groups)

    def part(name: str) -> Subset:
        if name == "wgrad":
            rows, counts = group_rows(p.sizes, groups, cap=None)
            r = jnp.asarray(rows)
            ref = _ref_tgmm(p.x[r], p.dout[r], jnp.asarray(counts))
            return Subset(index=groups, axis_is_group=True, ref=ref)
        rows, counts = group_rows(p.sizes, groups, cap=cap)
        r, c = jnp.asarray(rows), jnp.asarray(counts)
        if name == "forward":
            ref = _ref_gmm(p.x[r], p.w[g], c)
        elif name == "dgrad":
            ref = _ref_gmm(p.dout[r], p.w[g], c, transpose_rhs=True)
        else:
            ref = _ref_swiglu(p.x[r], p.w_gate[g], p.w_up[g], c)
        return Subset(index=rows, axis_is_group=False, ref=ref)

    for name in SUBSET_PARTS[product]:
        if name not in p.subsets:
            p.subsets[name] = part(name)
    return tuple(p.subsets[name] for name in SUBSET_PARTS[product])


@jax.jit
def _excess_by_group(out, ref, group_of_row):
    """Per group, the largest |out - ref| - TOL |ref| over its elements, in units of rms(ref)."""
    o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
    excess = jnp.abs(o - r) - TOL * jnp.abs(r)
    excess = excess / (jnp.sqrt(jnp.mean(r * r)) + jnp.float32(1e-30))
    if out.ndim == 3:  # [G, K, N]
        return jnp.max(excess, axis=(1, 2))
    per_row = jnp.max(excess, axis=1)
    return jax.ops.segment_max(per_row, group_of_row, num_segments=group_of_row.shape[0])


def failure_detail(out: jax.Array, ref: jax.Array, sizes: np.ndarray) -> dict:
    """Which groups fail (for a failed check): their count, the first few, their sizes."""
    if out.shape != ref.shape:
        return {}
    group_of_row = np.repeat(np.arange(len(sizes)), sizes)
    group_of_row = np.pad(group_of_row, (0, max(0, out.shape[0] - len(group_of_row))))
    ids = jnp.asarray(group_of_row[: out.shape[0]], jnp.int32)
    excess = np.asarray(_excess_by_group(out, ref, ids))[: len(sizes)]
    bad = np.flatnonzero(~(excess <= TOL))
    return {
        "bad_groups": len(bad),
        "of_groups": len(sizes),
        "first_bad": bad[:12].tolist(),
        "their_sizes": sizes[bad[:12]].tolist(),
        "their_excess_over_rms": [round(float(e), 4) for e in excess[bad[:12]]],
    }


def check(outs: tuple, full: tuple | None, subsets: tuple[Subset, ...], sizes: np.ndarray) -> dict:
    result: dict[str, Any] = {"ok": True, "parts": []}
    if len(outs) != len(subsets):
        return {"ok": False, "why": f"{len(outs)} outputs, expected {len(subsets)}"}
    for i, (out, subset) in enumerate(zip(outs, subsets, strict=True)):
        part: dict[str, Any] = {}
        if full is not None:
            part["vs_full_reference"] = compare(out, full[i])
            if not part["vs_full_reference"]["ok"]:
                part["vs_full_reference"]["detail"] = failure_detail(out, full[i], sizes)
        picked = out[jnp.asarray(subset.index)]
        part["vs_reference_subset"] = compare(picked, subset.ref)
        part["ok"] = all(c["ok"] for c in part.values())
        result["parts"].append(part)
        result["ok"] &= part["ok"]
    return result


# ---------------------------------------------------------------------------------------------
# Timing


def _warm_up(runner: Runner, *, warmup: int, target_sample_s: float) -> tuple[int, int]:
    """Warm-up and calibration of time_runner: (reps per sample, calls made)."""
    t0 = time.perf_counter()
    out = runner.call()
    runner.sync(out)
    single_s = time.perf_counter() - t0
    warm_calls = 1
    if single_s <= SLOW_CALL_S:
        for _ in range(warmup):
            out = runner.call()
            runner.sync(out)
        t0 = time.perf_counter()
        out = runner.call()
        runner.sync(out)
        single_s = time.perf_counter() - t0
        warm_calls += warmup + 1
    del out
    return max(1, min(50, round(target_sample_s / max(single_s, 1e-9)))), warm_calls


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
    """Median of `timed` samples after warm-up. A sample is `reps` back-to-back calls between two
    syncs, over reps; reps makes a sample last >= target_sample_s. A first call longer than
    SLOW_CALL_S (XLA's ragged_dot: 40-165 ms) is the whole warm-up (reps is 1 for it anyway),
    so a slow candidate costs 1 + timed calls here. `keep["out"]`: the last output."""
    reps, warm_calls = _warm_up(runner, warmup=warmup, target_sample_s=target_sample_s)
    samples = []
    for _ in range(timed):
        ms, out = _sample(runner, reps)
        samples.append(ms)
    if keep is not None:
        keep["out"] = out
    del out
    return _timing(samples, reps, warm_calls)


def time_paired(
    base: Runner,
    runner: Runner,
    *,
    warmup: int,
    timed: int,
    target_sample_s: float,
    keep: dict | None = None,
) -> tuple[dict, dict, dict]:
    """`runner` timed in alternation with `base` (torch): each side warmed up and calibrated as
    time_runner does, then sample i of base, sample i of runner, sample i+1 of base, ... (each
    sample time_runner's). Drift of the device's clocks, temperature or power over the run
    moves both sides of a pair alike, so the ratio of a pair (base_i / runner_i) carries less
    of it than the ratio of two medians timed seconds apart.

    Returns (runner's timing, base's timing, the ratios): timings as time_runner's; the ratios
    {"median", "p25", "p75", "min", "max", "ratios"} of base_i / runner_i (> 1: runner is
    faster). `keep["out"]`: runner's last output."""
    base_reps, base_warm = _warm_up(base, warmup=warmup, target_sample_s=target_sample_s)
    reps, warm_calls = _warm_up(runner, warmup=warmup, target_sample_s=target_sample_s)
    base_samples, samples = [], []
    for _ in range(timed):
        ms, base_out = _sample(base, base_reps)
        base_samples.append(ms)
        del base_out
        ms, out = _sample(runner, reps)
        samples.append(ms)
    if keep is not None:
        keep["out"] = out
    del out
    ratios = np.asarray(base_samples) / np.asarray(samples)
    paired = {
        "median": float(np.median(ratios)),
        "p25": float(np.percentile(ratios, 25)),
        "p75": float(np.percentile(ratios, 75)),
        "min": float(np.min(ratios)),
        "max": float(np.max(ratios)),
        "ratios": [round(float(r), 5) for r in ratios],
    }
    return (
        _timing(samples, reps, warm_calls),
        _timing(base_samples, base_reps, base_warm),
        paired,
    )


# ---------------------------------------------------------------------------------------------
# One problem


def make_problem(shape: Shape, torch_mod) -> Problem:
    sizes = group_sizes_for(shape)
    kx, kw, kd = jax.random.split(jax.random.key(SEED), 3)
    x = jax.random.normal(kx, (shape.m, shape.k), jnp.bfloat16)
    w = jax.random.normal(kw, (shape.g, shape.k, shape.n), jnp.bfloat16) * jnp.bfloat16(
        1.0 / math.sqrt(shape.k)
    )
    dout = jax.random.normal(kd, (shape.m, shape.n), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    w_gate = w_up = None
    if shape.gate_up:
        f = shape.n // 2
        w_gate, w_up = w[:, :, :f], w[:, :, f:]
    jax.block_until_ready((x, w, dout, gs, w_gate, w_up))
    p = Problem(shape, sizes, x, w, dout, gs, w_gate, w_up, torch=torch_mod)
    if torch_mod is not None:
        view = torch_mod.from_dlpack
        p.t = {"x": view(x), "w": view(w), "dout": view(dout)}
        p.t["offs"] = view(jnp.cumsum(gs).astype(jnp.int32))
        if shape.gate_up:
            p.t["w_gate"], p.t["w_up"] = view(w_gate), view(w_up)
    return p


def product_cost(shape: Shape, product: str, out_itemsize: int = 2) -> tuple[float, float]:
    """(flops, fewest bytes moved) of one product."""
    m, k, n, g = shape.m, shape.k, shape.n, shape.g
    flops = 2.0 * m * k * n * (2 if product == "backward" else 1)
    io = {
        "forward": (m * k + g * k * n) * 2 + m * n * out_itemsize,
        "dgrad": (m * n + g * k * n) * 2 + m * k * out_itemsize,
        "wgrad": (m * k + m * n) * 2 + g * k * n * out_itemsize,
        "backward": (m * n + g * k * n + m * k + m * n) * 2 + (m * k + g * k * n) * 2,
        "swiglu": (m * k + g * k * n) * 2 + m * (n // 2) * out_itemsize,
    }[product]
    return flops, float(io)


class Clock:
    """Seconds since `started_at` (a `time.time()`, default now) against `budget_s`: a candidate
    starts while the budget lasts, an extra while 70% of it lasts (bench.gmm_sweep's rule;
    the benchmark itself plans with `Planner`)."""

    def __init__(self, budget_s: float, *, started_at: float | None = None):
        before = 0.0 if started_at is None else max(0.0, time.time() - started_at)
        self.t0, self.budget_s = time.perf_counter() - before, budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def allows_anything(self) -> bool:
        return self.elapsed() < self.budget_s

    def allows(self, cand: Candidate) -> bool:
        limit = self.budget_s * (0.7 if cand.extra else 1.0)
        return self.elapsed() < limit

    def would_allow(self, cand: Candidate) -> bool:
        """Whether `cand` would start now (nothing recorded)."""
        return self.allows(cand)

    def skip_reason(self, cand: Candidate) -> str | None:
        """None if `cand` may start now, else the status to record."""
        if self.allows(cand):
            return None
        return f"skipped: time budget ({self.elapsed():.0f} s of {self.budget_s:.0f})"

    def finished(self, cand: Candidate, wall_s: float) -> None:
        """run_candidate's report that `cand` ran for wall_s (the Planner learns from it)."""


# ---------------------------------------------------------------------------------------------
# The time plan
#
# The whole run is one device call (the issue), so every piece of work is planned with a cost
# estimate and starts only if it ends before the budget together with everything of a higher
# priority still to come (lower tier). What does not fit is deferred to a second pass or
# recorded as skipped, with its estimate.

TIERS = {
    0: "targets: torch, our kernels, their inputs and references",
    1: "DESIGN.md's forward baselines (tokamax, jax example, XLA); ceilings",
    2: "the other baselines: tokamax dgrad/wgrad/VJP, XLA VJP",
    3: "extras; XLA dgrad and wgrad",
}
# Seconds, the upper end of the 2026-11-30 H200 walls (results/2026-11-30_grouped_gemm_baselines_
# h200_run2.json: torch 0.3-0.9 s, its autograd backward 2.3 s, tokamax 1.7-2.0 s, jax example
# 1.3-1.9 s; results/2026-11-30_gmm_sweep_h200.json: ours 1.8-3.8 s; reference parts 7-14 s with
# XLA's autotuner, gaps in the sweep log; the ceilings ~6 s). Triton and our custom_vjp backward
# were not measured. Once this run has measured a kind, 1.5x its mean replaces the table.
STATIC_COST_S = {
    ("torch", "gemm"): 1.5,
    ("torch", "backward"): 3.0,
    ("ours", "gemm"): 4.0,
    ("ours", "backward"): 8.0,
    ("ours", "triton"): 10.0,
    ("tokamax", "gemm"): 2.5,
    ("tokamax", "backward"): 4.0,
    ("jax_example", "gemm"): 2.5,
    ("reference", "part"): 12.0,
    ("setup", "inputs"): 3.0,
    ("ceilings", "ceilings"): 10.0,
}
# XLA ragged_dot, never calibrated (its compile varies most): 1.25x the wall measured on the H200
# for the shape and product (compile, autotuning included, and 17 calls; 2026-11-30 baselines
# run 1 (log: compile + 17 x median) and run 2 (JSON walls)), else XLA_COMPILE_S (the longest
# compile seen was 17.3 s) plus its calls at DESIGN.md's rate for the shape (4.9 TFLOP/s, the
# slowest, where DESIGN.md has none).
XLA_MEASURED_WALL_S = {
    ("qwen3_gate_up", "forward"): 15.3,
    ("qwen3_gate_up", "dgrad"): 13.0,
    ("qwen3_down", "forward"): 6.5,
    ("qwen3_down", "dgrad"): 7.2,
    ("qwen3_down", "wgrad"): 7.4,
    ("mixtral_gate_up", "forward"): 4.2,
    ("mixtral_gate_up", "dgrad"): 18.0,
    ("mixtral_gate_up", "wgrad"): 3.9,
    ("mixtral_gate_up", "backward"): 2.1,
    ("dsv3_ep8_gate_up", "forward"): 8.0,
    ("dsv3_ep8_gate_up", "dgrad"): 7.7,
}
XLA_COMPILE_S = 18.0
XLA_SLOWEST_TFLOPS = 4.9
SLOW_CALL_S = 0.05  # a call this long skips the extra warm-up: the checked runs warmed it up
H200_JAX_BYTES = int(0.8 * 139 * 2**30)  # the XLA guard's estimate when not on the GPU


@dataclasses.dataclass
class Step:
    """One planned piece of work: a shape's inputs, a product's reference parts, a candidate."""

    shape: str
    product: str  # a PRODUCTS entry, "setup" or "ceilings"
    name: str  # the candidate's name, "reference.py", "inputs" or "ceilings"
    family: str  # a FAMILIES entry, "reference", "setup" or "ceilings"
    tier: int
    kind: str  # with family, the key of STATIC_COST_S and of what this run measured
    static_s: float  # the estimate before this run measured anything
    units: int = 1  # reference parts in a reference step
    state: str = "planned"  # planned, running, done, skipped


def candidate_tier(cand: Candidate, product: str) -> int:
    """0 torch and ours (not extras), 1 the other forward baselines, 2 the other baselines,
    3 extras and XLA's dgrad and wgrad (slowest, least telling: 4-100 TFLOP/s)."""
    if cand.family in ("torch", "ours") and not cand.extra:
        return 0
    if cand.extra or (cand.family == "xla" and product in ("dgrad", "wgrad")):
        return 3
    return 1 if product == "forward" else 2


def _cost_kind(cand: Candidate, product: str) -> str:
    if product == "backward":
        return "backward"
    return "triton" if "triton" in cand.name else "gemm"


def xla_estimate(shape: Shape, product: str, args) -> float:
    """Seconds for an XLA ragged_dot candidate: compile plus its calls; ~1 s where the dense
    guard refuses it."""
    if product in ("wgrad", "backward"):
        available = _jax_memory_available() or H200_JAX_BYTES
        if _xla_dense_bytes(shape, product) > available:
            return 1.0
    measured = XLA_MEASURED_WALL_S.get((shape.name, product))
    if measured is not None:
        return 1.25 * measured
    flops, _ = product_cost(shape, product)
    call_s = flops / (shape.design_tflops.get("xla ragged_dot", XLA_SLOWEST_TFLOPS) * 1e12)
    calls = args.repeats + 1 + args.timed + 1 + (0 if call_s > SLOW_CALL_S else args.warmup)
    return XLA_COMPILE_S + calls * call_s


def plan_steps(args, torch_mod, *, ceilings: bool) -> list[Step]:
    """Every step of the run in the order it runs, from the candidate lists themselves."""
    steps = []
    cost = STATIC_COST_S
    if ceilings:
        steps.append(
            Step(
                "", "ceilings", "ceilings", "ceilings", 1, "ceilings", cost["ceilings", "ceilings"]
            )
        )
    for shape in args.shape_list:
        steps.append(
            Step(shape.name, "setup", "inputs", "setup", 0, "inputs", cost["setup", "inputs"])
        )
        bench = Bench(args, Problem.placeholder(shape, torch_mod))
        seen: set[str] = set()
        for product in args.products:
            if product == "swiglu" and not shape.gate_up:
                continue
            parts = [x for x in SUBSET_PARTS[product] if x not in seen]
            seen.update(parts)
            if parts:
                est = len(parts) * cost["reference", "part"]
                steps.append(
                    Step(
                        shape.name, product, "reference.py", "reference", 0, "part", est, len(parts)
                    )
                )
            for cand in bench.candidates(product):
                kind = _cost_kind(cand, product)
                est = (
                    xla_estimate(shape, product, args)
                    if cand.family == "xla"
                    else cost.get((cand.family, kind), cost[cand.family, "gemm"])
                )
                tier = candidate_tier(cand, product)
                steps.append(Step(shape.name, product, cand.name, cand.family, tier, kind, est))
    return steps


class Planner(Clock):
    """The Clock of the benchmark: admits a step when its estimate plus the estimates of every
    step of a higher priority (lower tier) still planned fit in the time left. `tiers`: what
    each tier holds, for the summary (another benchmark's subclass names its own)."""

    tiers: dict[int, str] = TIERS

    def __init__(self, budget_s: float, steps: list[Step], *, started_at: float | None = None):
        super().__init__(budget_s, started_at=started_at)
        self.steps = steps
        self.index = {(s.shape, s.product, s.name): s for s in steps}
        self.measured: dict[tuple[str, str], list[float]] = {}
        self.where = ("", "")  # (shape, product) of the candidates run_candidate sees
        self.current: Step | None = None
        self.plan_total_s = sum(s.static_s for s in steps)
        self.defer = True  # the first pass defers what does not fit (tiers > 0)

    def estimate(self, step: Step) -> float:
        seen = self.measured.get((step.family, step.kind))
        if step.family == "xla" or not seen:
            return step.static_s
        return 1.5 * step.units * sum(seen) / len(seen)

    def held_for(self, step: Step) -> float:
        """Estimated seconds of the steps still planned that outrank `step`."""
        return sum(
            self.estimate(s)
            for s in self.steps
            if s.state == "planned" and s.tier < step.tier and s is not step
        )

    def fits(self, step: Step) -> bool:
        return step.state == "planned" and (
            self.estimate(step) + self.held_for(step) <= self.budget_s - self.elapsed()
        )

    def would_allow(self, cand: Candidate) -> bool:
        step = self.step(*self.where, cand.name)
        return super().would_allow(cand) if step is None else self.fits(step)

    def admit(self, step: Step) -> str | None:
        """None, and the step is running, if it fits; else the skip status. A step of tier > 0
        that does not fit in the first pass is deferred (`rerun_deferred` tries it again once
        the first pass is over; the estimates of tiers < its own are upper ends, so time is
        often left), any other is skipped."""
        est, held = self.estimate(step), self.held_for(step)
        left = self.budget_s - self.elapsed()
        if est + held <= left:
            step.state, self.current = "running", step
            return None
        step.state = "deferred" if self.defer and step.tier > 0 else "skipped"
        held_txt = f" + {held:.0f} s held for tiers < {step.tier}" if held else ""
        verb = "deferred" if step.state == "deferred" else "skipped"
        return (
            f"{verb}: time budget (needs ~{est:.0f} s{held_txt}; {max(left, 0):.0f} s of "
            f"{self.budget_s:.0f} left)"
        )

    def finish(self, step: Step, wall_s: float) -> None:
        step.state, self.current = "done", None
        self.measured.setdefault((step.family, step.kind), []).append(wall_s / step.units)

    def skip(self, shape: str, product: str | None = None) -> None:
        """Every step of a shape (or of one of its products) not run yet is skipped."""
        for s in self.steps:
            if (
                s.shape == shape
                and s.state in ("planned", "deferred")
                and product in (None, s.product)
            ):
                s.state = "skipped"

    def plan_deferred_again(self) -> dict[str, list[Step]]:
        """The second pass: every deferred step planned again (no more deferring), by shape."""
        self.defer = False
        by_shape: dict[str, list[Step]] = {}
        for s in self.steps:
            if s.state == "deferred":
                s.state = "planned"
                by_shape.setdefault(s.shape, []).append(s)
        return by_shape

    def step(self, shape: str, product: str, name: str) -> Step | None:
        return self.index.get((shape, product, name))

    def skip_reason(self, cand: Candidate) -> str | None:
        step = self.step(*self.where, cand.name)
        if step is None:  # not planned (a test's stand-in): the plain budget rule
            return super().skip_reason(cand)
        return self.admit(step)

    def finished(self, cand: Candidate, wall_s: float) -> None:
        step = self.step(*self.where, cand.name)
        if step is not None and step.state == "running":
            self.finish(step, wall_s)

    def summary(self) -> dict:
        by_tier = {}
        for tier, what in self.tiers.items():
            steps = [s for s in self.steps if s.tier == tier]
            by_tier[str(tier)] = {
                "what": what,
                "steps": len(steps),
                "done": sum(s.state == "done" for s in steps),
                "skipped": sum(s.state == "skipped" for s in steps),
                "deferred": sum(s.state == "deferred" for s in steps),
                "planned_s": round(sum(s.static_s for s in steps), 1),
            }
        return {
            "budget_s": self.budget_s,
            "static_estimate_s": round(self.plan_total_s, 1),
            "tiers": by_tier,
            "measured_mean_s": {
                f"{family} {kind}": round(sum(v) / len(v), 2)
                for (family, kind), v in sorted(self.measured.items())
            },
        }


class Watchdog:
    """Ends the run at `limit_s` on the clock if it is still going: `stop(what was running)`
    writes the results and exits, so the device call returns its files instead of being killed
    (a hung kernel, an estimate far too low)."""

    def __init__(self, clock: Clock, limit_s: float, stop: Callable[[str], None]):
        self.clock, self.limit_s, self.stop = clock, limit_s, stop
        self.timer = threading.Timer(max(0.0, limit_s - clock.elapsed()), self.fire)
        self.timer.daemon = True

    def start(self) -> Watchdog:
        self.timer.start()
        return self

    def cancel(self) -> None:
        self.timer.cancel()

    def fire(self) -> None:
        step = getattr(self.clock, "current", None)
        what = "nothing planned" if step is None else f"{step.shape} {step.product} {step.name}"
        self.stop(f"stopped by the watchdog at {self.clock.elapsed():.0f} s while running: {what}")


def _run_in_step(cand, p, product, *, full, subsets, args, clock, torch_run, keep=None):
    """`run_candidate` for one candidate of a (shape, product) step: ours are timed paired
    with torch's runner when there is one and --paired is on."""
    return run_candidate(
        cand,
        product=product,
        full=full,
        subsets=subsets,
        sizes=p.sizes,
        args=args,
        clock=clock,
        paired_with=torch_run if cand.family == "ours" and args.paired else None,
        keep=keep,
    )


def run_candidate(
    cand: Candidate,
    *,
    product,
    full,
    subsets,
    sizes,
    args,
    clock,
    paired_with: Runner | None = None,
    keep: dict | None = None,
) -> tuple[dict, tuple]:
    """Build, check, repeat (bitwise), time, and compare the last timed output bitwise too.
    Returns the record and the checked outputs.

    paired_with: a built torch runner of the same product: the candidate is timed in
    alternation with it (time_paired), and the record gets "x_torch_paired" (the median of the
    per-pair ratios torch_i / ours_i), "x_torch_paired_p25_p75" and "paired" (torch's timing of
    the pairs, every ratio). keep: gets "runner", the built runner (to pair others with it)."""
    rec: dict[str, Any] = {"name": cand.name, "family": cand.family, "extra": cand.extra}
    if cand.config_source:
        rec["config_source"] = cand.config_source
    skipped = clock.skip_reason(cand)
    if skipped is not None:
        rec["status"] = skipped
        if cand.config and not callable(cand.config):
            rec["config"] = cand.config
        return rec, ()
    t_start = time.perf_counter()
    outs: tuple = ()
    try:
        outs = _build_check_time(cand, rec, full, subsets, sizes, args, paired_with, keep)
    finally:
        rec["wall_s"] = round(time.perf_counter() - t_start, 2)
        rec["t_end_s"] = round(clock.elapsed(), 1)
        clock.finished(cand, rec["wall_s"])
    return rec, outs


def _build_check_time(
    cand: Candidate,
    rec: dict,
    full,
    subsets,
    sizes,
    args,
    paired_with: Runner | None = None,
    keep_runner: dict | None = None,
) -> tuple:
    if cand.config:
        try:
            rec["config"] = cand.config() if callable(cand.config) else cand.config
        except Exception as e:  # e.g. the module does not import: build() reports it
            rec["config"] = f"could not describe it: {e!r}"[:300]
    try:
        runner = cand.build()
    except NotAvailable as e:
        rec["status"] = f"not available: {e}"
        return ()
    except Exception as e:  # a candidate that raises is reported, not fatal
        rec["status"] = f"not available: {type(e).__name__}: {e}"[:1500]
        rec["traceback"] = traceback.format_exc()[-3000:]
        return ()
    rec["compile_s"] = round(runner.compile_s, 3)
    rec.update(runner.info)
    if keep_runner is not None:
        keep_runner["runner"] = runner
    outs: tuple = ()
    try:
        first = runner.call()
        runner.sync(first)
        outs = runner.to_jax(first)
        rec["check"] = check(outs, full, subsets, sizes)
        same = True
        for _ in range(args.repeats - 1):
            again = runner.to_jax(runner.call())
            same &= _all_bits_equal(outs, again)
            del again
        rec["bitwise_repeatable"] = {"runs": args.repeats, "identical": bool(same)}
        if not rec["check"]["ok"] and not args.time_failed:
            rec["status"] = "failed check (not timed)"
            return outs
        keep: dict[str, Any] = {}
        how = dict(warmup=args.warmup, timed=args.timed, target_sample_s=args.sample_s, keep=keep)
        if paired_with is None:
            rec["timing"] = time_runner(runner, **how)
        else:
            rec["timing"], torch_timing, ratios = time_paired(paired_with, runner, **how)
            rec["x_torch_paired"] = ratios["median"]
            rec["x_torch_paired_p25_p75"] = [ratios["p25"], ratios["p75"]]
            rec["paired"] = {"torch_timing": torch_timing, "x_torch": ratios}
        last = runner.to_jax(keep.pop("out"))
        rec["bitwise_repeatable"]["last_timed_run_identical"] = _all_bits_equal(outs, last)
        del last
        rec["status"] = "ok" if rec["check"]["ok"] else "FAILED CHECK (timed: --time-failed)"
    except Exception as e:
        rec["status"] = f"error: {type(e).__name__}: {e}"[:1500]
        rec["traceback"] = traceback.format_exc()[-3000:]
    return outs


def _all_bits_equal(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(bool(_bits_equal(x, y)) for x, y in zip(a, b, strict=True))


def run_problem(shape: Shape, args, clock: Clock, torch_mod, save: Callable[[dict], None]) -> dict:
    """All products of one shape; `save(partial_result)` after every candidate. With a Planner
    as the clock, the inputs and each product's reference parts are planned steps too."""
    t0 = time.perf_counter()
    planner = clock if isinstance(clock, Planner) else None
    sizes = group_sizes_for(shape)
    result: dict[str, Any] = {
        "shape": dataclasses.asdict(shape),
        "routing": (
            f"Zipf: size proportional to 1/rank^{ZIPF_EXPONENT}, largest-remainder rounding, "
            f"shuffled (seed {SEED})"
            if shape.routing == "zipf"
            else f"multinomial of M rows over G equally likely groups (seed {SEED})"
        ),
        "group_sizes": {
            "min": int(sizes.min()),
            "median": float(np.median(sizes)),
            "max": int(sizes.max()),
            "empty": int((sizes == 0).sum()),
            "sum": int(sizes.sum()),
        },
        "products": {},
    }
    if args.smoke:
        result["group_sizes"]["all"] = sizes.tolist()
    print(
        f"== {shape.name} M={shape.m} K={shape.k} N={shape.n} G={shape.g} ({shape.routing}); "
        f"group sizes {result['group_sizes']} [t={clock.elapsed():.0f}s]",
        flush=True,
    )
    setup = planner.step(shape.name, "setup", "inputs") if planner else None
    skipped = planner.admit(setup) if setup else None
    if skipped is None and not clock.allows_anything():
        skipped = f"skipped: time budget ({clock.elapsed():.0f} s of {clock.budget_s:.0f})"
    if skipped is not None:
        if planner:
            planner.skip(shape.name)
        result["skipped"] = skipped
        print(f"  {skipped}", flush=True)
        return result
    try:
        p = make_problem(shape, torch_mod)
    except Exception as e:  # recorded; the other shapes still run
        result["skipped"] = f"error making the inputs: {type(e).__name__}: {e}"[:1500]
        result["traceback"] = traceback.format_exc()[-3000:]
        if planner:
            planner.skip(shape.name)
        print(f"  {result['skipped'][:200]}", flush=True)
        return result
    if setup:
        planner.finish(setup, time.perf_counter() - t0)
    bench = Bench(args, p)
    for product in args.products:
        if product == "swiglu" and not shape.gate_up:
            continue
        flops, nbytes = product_cost(shape, product)
        entry: dict[str, Any] = {"flops": flops, "min_bytes_bf16_out": nbytes}
        result["products"][product] = entry
        ref = planner.step(shape.name, product, "reference.py") if planner else None
        skipped = planner.admit(ref) if ref else None
        if skipped is None and not clock.allows_anything():
            skipped = f"skipped: time budget ({clock.elapsed():.0f} s of {clock.budget_s:.0f})"
        if skipped is not None:
            if planner:
                planner.skip(shape.name, product)
            entry["skipped"] = skipped
            print(f"  {product:8s} {skipped}", flush=True)
            save(result)
            continue
        t_ref = time.perf_counter()
        try:
            subsets = subset_reference(p, product, cap=args.subset_rows)
        except Exception as e:  # recorded; the other products still run
            entry["skipped"] = f"error in reference.py parts: {type(e).__name__}: {e}"[:1500]
            entry["traceback"] = traceback.format_exc()[-3000:]
            if planner:
                planner.skip(shape.name, product)
            print(f"  {product:8s} {entry['skipped'][:200]}", flush=True)
            save(result)
            continue
        entry["reference_s"] = round(time.perf_counter() - t_ref, 2)
        if ref:
            planner.finish(ref, entry["reference_s"])
        entry["candidates"], entry["full_reference"] = [], "torch"
        full = None
        torch_run: Runner | None = None  # checked and timed: ours are timed paired with it
        if planner:
            planner.where = (shape.name, product)
        for cand in bench.candidates(product):
            if cand.family not in ("torch", "ours"):
                torch_run = None  # ours are done (FAMILIES order): XLA may need the memory
            if full is None and cand.family != "torch" and clock.would_allow(cand):
                # torch did not run (or failed its check): XLA in f32 checks all elements.
                full = full_reference(p, product)
                entry["full_reference"] = "xla ragged_dot / reference.tgmm in f32 (no torch)"
            keep: dict[str, Any] = {}
            rec, outs = _run_in_step(
                cand,
                p,
                product,
                full=full,
                subsets=subsets,
                args=args,
                clock=clock,
                torch_run=torch_run,
                keep=keep if cand.family == "torch" else None,
            )
            rec.setdefault("t_end_s", round(clock.elapsed(), 1))
            if cand.family == "torch" and rec.get("check", {}).get("ok"):
                full = outs  # torch's result: the all-elements reference of the others
                torch_run = keep.get("runner") if "timing" in rec else None
            del outs, keep
            if "timing" in rec:
                rec["tflops"] = flops / (rec["timing"]["median_ms"] * 1e-3) / 1e12
            entry["candidates"].append(rec)
            _ratios(entry)
            _print_rec(product, rec, entry["torch_median_ms"])
            result["wall_s"] = round(time.perf_counter() - t0, 1)
            save(result)
        if product == "backward":
            _derive_ours_backward(result["products"], entry)
        del full, torch_run
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        save(result)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    del p, bench
    if torch_mod is not None and jax.default_backend() == "gpu":
        torch_mod.cuda.empty_cache()
    return result


def rerun_deferred(
    shape: Shape,
    args,
    planner: Planner,
    torch_mod,
    result: dict,
    save: Callable[[dict], None],
    steps: list[Step],
) -> None:
    """The second pass over one shape: `steps`, deferred in the first pass and planned again
    (with those of every shape, so they compete tier by tier), run if they fit now, each
    replacing its record in `result`. Costs the inputs again, the reference parts (compiled
    already) and one torch call per product for the all-elements reference; none of it if
    nothing fits."""
    if not steps:
        return
    products = [x for x in args.products if any(s.product == x for s in steps)]

    def guess(family: str, kind: str) -> float:
        seen = planner.measured.get((family, kind))
        return 1.5 * sum(seen) / len(seen) if seen else STATIC_COST_S[family, kind]

    # The reference parts compiled in the first pass: a second computation is ~1 s at most.
    overhead = guess("setup", "inputs") + len(products) * (1.0 + guess("torch", "gemm"))
    left = planner.budget_s - planner.elapsed()
    if overhead + min(planner.estimate(s) for s in steps) > left:
        reason = f"skipped: time budget (second pass: {left:.0f} s left)"
        _mark_skipped(result, steps, reason)
        planner.skip(shape.name)
        save(result)
        return
    print(
        f"== {shape.name}: second pass, {len(steps)} steps [t={planner.elapsed():.0f}s]", flush=True
    )
    p = make_problem(shape, torch_mod)
    bench = Bench(args, p)
    for product in products:
        names = {s.name for s in steps if s.product == product}
        entry = result["products"][product]
        if not any(planner.fits(s) for s in steps if s.product == product):
            continue  # skipped below
        full = None
        torch_run: Runner | None = None  # ours deferred here are timed paired with it
        try:
            subsets = subset_reference(p, product, cap=args.subset_rows)
            torch_rec = next((c for c in entry["candidates"] if c["family"] == "torch"), None)
            if torch_rec is not None and torch_rec.get("check", {}).get("ok"):
                (cand,) = [c for c in bench.candidates(product) if c.name == torch_rec["name"]]
                torch_run = cand.build()
                full = torch_run.to_jax(torch_run.call())
        except Exception as e:  # recorded on the deferred candidates; the others go on
            reason = f"skipped: second pass could not prepare: {type(e).__name__}: {e}"[:1500]
            _mark_skipped(result, [s for s in steps if s.product == product], reason)
            planner.skip(shape.name, product)
            continue
        planner.where = (shape.name, product)
        for cand in bench.candidates(product):
            if cand.name not in names:
                continue
            if full is None and planner.would_allow(cand):
                full = full_reference(p, product)
            rec, outs = _run_in_step(
                cand,
                p,
                product,
                full=full,
                subsets=subsets,
                args=args,
                clock=planner,
                torch_run=torch_run,
            )
            del outs
            rec["second_pass"] = True
            if "timing" in rec:
                rec["tflops"] = entry["flops"] / (rec["timing"]["median_ms"] * 1e-3) / 1e12
            entry["candidates"] = [
                rec if c["name"] == cand.name else c for c in entry["candidates"]
            ]
            _ratios(entry)
            _print_rec(product, rec, entry["torch_median_ms"])
            save(result)
        del full, torch_run
    left_over = [s for s in steps if s.state in ("planned", "deferred")]
    _mark_skipped(result, left_over, "skipped: time budget (second pass)")
    planner.skip(shape.name)
    del p, bench
    if torch_mod is not None and jax.default_backend() == "gpu":
        torch_mod.cuda.empty_cache()
    save(result)


def _mark_skipped(result: dict, steps: list[Step], reason: str) -> None:
    keys = {(s.product, s.name) for s in steps}
    for product, entry in result["products"].items():
        for c in entry.get("candidates", []):
            if (product, c["name"]) in keys and c["status"].startswith("deferred"):
                c["status"] = f"{reason}; first pass: {c['status']}"


def _ratios(entry: dict) -> None:
    torch_ms = next(
        (
            c["timing"]["median_ms"]
            for c in entry["candidates"]
            if c["family"] == "torch" and "timing" in c
        ),
        None,
    )
    entry["torch_median_ms"] = torch_ms
    for c in entry["candidates"]:
        if torch_ms is not None and "timing" in c:
            c["x_torch"] = torch_ms / c["timing"]["median_ms"]


def _derive_ours_backward(products: dict, entry: dict) -> None:
    """Our backward as the sum of the dgrad and wgrad (bf16 out) medians, beside the
    custom_vjp's own time."""
    dgrad = _find(products.get("dgrad"), "ours mosaic_gpu.gmm(transpose_rhs)")
    wgrad = _find(products.get("wgrad"), "ours tgmm (bf16 out)")
    if dgrad is None or wgrad is None:
        return
    ms = dgrad["timing"]["median_ms"] + wgrad["timing"]["median_ms"]
    rec = {
        "name": "ours dgrad + wgrad (sum of medians)",
        "family": "ours",
        "extra": False,
        "status": "derived",
        "timing": {"median_ms": ms},
        "tflops": entry["flops"] / (ms * 1e-3) / 1e12,
        "bitwise_repeatable": {
            "identical": dgrad["bitwise_repeatable"]["identical"]
            and wgrad["bitwise_repeatable"]["identical"],
            "runs": dgrad["bitwise_repeatable"]["runs"],
        },
        "check": {"ok": dgrad["check"]["ok"] and wgrad["check"]["ok"]},
    }
    if entry.get("torch_median_ms"):
        rec["x_torch"] = entry["torch_median_ms"] / ms
    entry["candidates"].append(rec)


def _find(entry: dict | None, name: str) -> dict | None:
    if not entry:
        return None
    for c in entry.get("candidates", []):
        if c["name"] == name and "timing" in c:
            return c
    return None


def _print_rec(product: str, rec: dict, torch_ms: float | None) -> None:
    when = f"t={rec.get('t_end_s', 0):.0f}s"
    if "timing" in rec:
        t = rec["timing"]
        ratio = f" {torch_ms / t['median_ms']:.2f}x torch" if torch_ms else ""
        if "x_torch_paired" in rec:
            lo, hi = rec["x_torch_paired_p25_p75"]
            ratio += f" (paired {rec['x_torch_paired']:.3f}x, p25-p75 {lo:.3f}-{hi:.3f})"
        bits = "bitwise" if rec["bitwise_repeatable"]["identical"] else "NOT bitwise"
        print(
            f"  {product:8s} {rec['name']:40s} {t['median_ms']:9.3f} ms "
            f"{rec.get('tflops', 0):7.1f} TFLOP/s{ratio} [{bits}; compile "
            f"{rec.get('compile_s', 0):.1f} s; {when}]",
            flush=True,
        )
        return
    print(f"  {product:8s} {rec['name']:40s} {rec['status'][:160]} [{when}]", flush=True)
    for part in rec.get("check", {}).get("parts", []):
        if not part["ok"]:
            brief = {
                k: {x: v[x] for x in ("ok", "rel_fro", "max_err_over_rms", "detail") if x in v}
                for k, v in part.items()
                if isinstance(v, dict)
            }
            print(f"    check: {json.dumps(brief)[:900]}", flush=True)


# ---------------------------------------------------------------------------------------------
# Ceilings, environment, output


def measure_ceilings(torch_mod) -> dict:
    """Dense bf16 matmul 8192^3 (torch and XLA) and a device copy: the rates to hold us to."""
    out: dict[str, Any] = {}
    n = 8192
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    runner = jax_runner(jnp.matmul, a, b)
    t = time_runner(runner, warmup=2, timed=10, target_sample_s=0.005)
    out["xla_matmul_8192_tflops"] = 2 * n**3 / (t["median_ms"] * 1e-3) / 1e12
    if torch_mod is not None:
        ta, tb = torch_mod.from_dlpack(a), torch_mod.from_dlpack(b)
        r = torch_runner(torch_mod, lambda: ta @ tb, on_gpu=True)
        t = time_runner(r, warmup=2, timed=10, target_sample_s=0.005)
        out["torch_matmul_8192_tflops"] = 2 * n**3 / (t["median_ms"] * 1e-3) / 1e12
        src = torch_mod.empty(2**31, dtype=torch_mod.uint8, device="cuda").random_(0, 255)
        dst = torch_mod.empty_like(src)
        r = torch_runner(torch_mod, lambda: dst.copy_(src), on_gpu=True)
        t = time_runner(r, warmup=2, timed=10, target_sample_s=0.005)
        out["copy_tb_per_s_read_plus_write"] = 2 * src.numel() / (t["median_ms"] * 1e-3) / 1e12
        del src, dst, ta, tb
        torch_mod.cuda.empty_cache()
    return out


def environment(torch_mod, args) -> dict:
    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(
            [os.path.basename(sys.executable), "-m", "bench.grouped_gemm_h200", *sys.argv[1:]]
        ),
        "device_command": DEVICE_COMMAND,
        "jax": jax.__version__,
        "jaxlib": importlib.import_module("jaxlib").__version__,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "xla_env": {k: v for k, v in os.environ.items() if k.startswith("XLA_")},
        "torch": getattr(torch_mod, "__version__", f"not available: {args.torch_missing}"),
    }
    try:
        tokamax, _ = _import_tokamax()
        env["tokamax"] = tokamax.__version__
    except Exception as e:
        env["tokamax"] = f"not available: {e!r}"
    try:
        env["triton"] = importlib.import_module("triton").__version__
    except Exception:
        env["triton"] = "not available"
    if torch_mod is not None and jax.default_backend() == "gpu":
        env["torch_device"] = torch_mod.cuda.get_device_name(0)
    try:
        env["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except Exception:  # the device copy of the tree may have no .git
        env["git_commit"] = "unknown (no git checkout)"
    return env


def _fmt_ms(c: dict) -> str:
    return f"{c['timing']['median_ms']:.3f}" if "timing" in c else "-"


def _bits_cell(c: dict) -> str:
    b = c.get("bitwise_repeatable")
    if b is None:
        return ""
    if not b["identical"]:
        return f"bitwise x{b['runs']}: **NO**"
    if b.get("last_timed_run_identical") is False:
        return f"bitwise x{b['runs']}: yes; last timed run: **NO**"
    return f"bitwise x{b['runs']}: yes"


def _status_cell(c: dict) -> str:
    bits = _bits_cell(c)
    bits = f"; {bits}" if bits else ""
    if c.get("check", {}).get("ok") is False and "parts" in c["check"]:
        worst = [
            f"rel {v['rel_fro']:.1e} vs {k.removeprefix('vs_')}"
            for part in c["check"]["parts"]
            for k, v in part.items()
            if isinstance(v, dict) and not v.get("ok", True) and "rel_fro" in v
        ]
        return f"**{c['status']}**: " + ", ".join(worst[:2]) + bits
    if "timing" in c:
        return "ok" + bits + ("; second pass" if c.get("second_pass") else "")
    return c["status"].replace("|", "/")[:200]


def design_deviation(shape: dict, entry: dict) -> list[dict]:
    """DESIGN.md's forward TFLOP/s against this run's, per candidate DESIGN.md names; the same
    as milliseconds a call (a constant per-call difference shows there)."""
    rows = []
    for c in entry.get("candidates", []):
        want = shape["design_tflops"].get(c["name"])
        if want is None:
            continue
        got = c.get("tflops")
        row = {
            "candidate": c["name"],
            "design": want,
            "measured": got,
            "deviation": None if got is None else (got - want) / want,
            "design_ms": entry["flops"] / (want * 1e12) * 1e3,
            "measured_ms": c["timing"]["median_ms"] if "timing" in c else None,
            "status": c["status"],
        }
        rows.append(row)
    return rows


def _main_candidates(entries: list[dict]) -> list[str]:
    """Candidate names of a product across shapes, in family order, extras last."""
    names: dict[str, tuple[int, int]] = {}
    for entry in entries:
        for c in entry.get("candidates", []):
            names.setdefault(c["name"], (int(c.get("extra", False)), FAMILIES.index(c["family"])))
    return sorted(names, key=lambda n: names[n])


def _cell(c: dict | None) -> str:
    if c is None:
        return "-"
    if "tflops" in c:
        ratio = f" ({c['x_torch']:.2f}x)" if "x_torch" in c else ""
        fail = " **FAILED CHECK**" if not c.get("check", {}).get("ok", True) else ""
        return f"{c['tflops']:.1f}{ratio}{fail}"
    status = c["status"]
    for short in ("failed check", "not available", "skipped", "deferred", "error"):
        if status.lower().startswith(short):
            return short
    return status[:40]


def _target_ratio(c: dict) -> float:
    """The ratio a target is judged on: the paired one where it exists."""
    return c.get("x_torch_paired", c["x_torch"])


def _target_cell(c: dict) -> str:
    if "x_torch_paired" not in c:
        return f"{c['x_torch']:.3f}x"
    lo, hi = c["x_torch_paired_p25_p75"]
    return f"{c['x_torch_paired']:.3f}x paired [{lo:.3f}-{hi:.3f}] (unpaired {c['x_torch']:.3f}x)"


def _paired_cell(c: dict) -> str:
    if "x_torch_paired" not in c:
        return "-"
    lo, hi = c["x_torch_paired_p25_p75"]
    torch_ms = c["paired"]["torch_timing"]["median_ms"]
    return f"{c['x_torch_paired']:.3f} [{lo:.3f}-{hi:.3f}]; torch {torch_ms:.3f} ms"


def render_markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        "# Grouped GEMM on the H200: our kernels against torch, tokamax, XLA",
        "",
        f"- command: `{env['command']}` (device: `{env['device_command']}`)",
        f"- date (UTC): {env['date_utc']}; device: {env['device']} ({env['backend']}); "
        f"jax {env['jax']}, torch {env['torch']}, tokamax {env['tokamax']}, "
        f"triton {env['triton']}; git {env['git_commit']}",
        f"- method: {results['method']}",
    ]
    if results.get("our_configs"):
        ours = results["our_configs"]
        lines.append(
            f"- our kernels' tile configs: {ours['source']} (each in 'Tile configs' below)"
            + "".join(
                f"; {pair}: {best['label']}" for pair, best in ours.get("from_sweep", {}).items()
            )
        )
    if results.get("ceilings"):
        c = results["ceilings"]
        lines.append(
            "- ceilings measured in this run: "
            + ", ".join(f"{k} = {v:.1f}" for k, v in c.items() if isinstance(v, float))
            + "".join(f"; {k}: {v}" for k, v in c.items() if not isinstance(v, float))
        )
    plan = results.get("plan")
    if plan:
        tiers = "; ".join(
            f"tier {k} ({t['what']}): {t['done']} of {t['steps']} steps done (found not "
            f"available included), {t['skipped']} skipped"
            for k, t in plan["tiers"].items()
        )
        lines.append(
            f"- time: {results.get('elapsed_s', '-')} s of a {plan['budget_s']:.0f}-s budget "
            f"from the device command's start (the plan's table estimate: "
            f"{plan['static_estimate_s']:.0f} s); {tiers}"
        )
    if results.get("stopped"):
        lines.append(f"- **{results['stopped']}**")
    lines += ["", "## Targets (ours against torch, measured side by side)", ""]
    lines += [
        "A cell: the paired ratio where there is one (our kernel timed in alternation with "
        "torch: the median of the per-pair ratios torch_i / ours_i, [25th-75th percentile]), "
        "judged against the target; then, as `unpaired`, torch's median over ours from their "
        "separate timings (each carries the other's drift: up to ~5% run to run). A cell "
        "without `paired` is the unpaired ratio, judged.",
        "",
        "| shape | forward x torch, paired (>= 1.0) | dgrad x torch, paired (>= 0.9) "
        "| wgrad x torch, paired (>= 0.9) | backward x torch, paired | swiglu x torch, paired "
        "| bitwise (all ours) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    want = {"forward": 1.0, "dgrad": 0.9, "wgrad": 0.9, "backward": None, "swiglu": None}
    main = {
        "forward": "ours mosaic_gpu.gmm",
        "dgrad": "ours mosaic_gpu.gmm(transpose_rhs)",
        "wgrad": "ours tgmm (bf16 out)",
        "backward": "ours ops.gmm backward (custom_vjp)",  # else the sum of dgrad and wgrad
        "swiglu": "ours mosaic_gpu.gmm_swiglu",
    }
    for s in results["shapes"]:
        cells, bits = [], []
        for product in PRODUCTS:
            entry = s["products"].get(product)
            if entry is None or "candidates" not in entry:
                cells.append("-" if entry is None else "skipped")
                continue
            ours = [c for c in entry["candidates"] if c["family"] == "ours" and not c["extra"]]
            if main[product]:
                ours = [c for c in ours if c["name"] == main[product]] or ours
            timed = [c for c in ours if "x_torch" in c]
            if timed:
                best = max(timed, key=_target_ratio)
                ratio = _target_ratio(best)
                mark = ""
                if want[product] is not None:
                    mark = " (met)" if ratio >= want[product] else " (**missed**)"
                cells.append(_target_cell(best) + mark)
            elif any("timing" in c for c in ours):
                cells.append("no torch time")
            else:
                cells.append(ours[0]["status"].split(":")[0] if ours else "-")
            for c in entry["candidates"]:
                if c["family"] == "ours" and "bitwise_repeatable" in c and c["status"] != "derived":
                    bits.append(_bits_cell(c))
        if not bits:
            bit_cell = "-"
        elif all(b.endswith(": yes") for b in bits):
            bit_cell = bits[0].split(":")[0] + ": yes"
        else:
            bit_cell = "; ".join(b for b in bits if not b.endswith(": yes"))
        if s.get("skipped"):
            cells = ["skipped"] * len(PRODUCTS)
        lines.append(f"| {s['shape']['name']} | " + " | ".join(cells) + f" | {bit_cell} |")
    lines += [
        "",
        "## TFLOP/s (x torch) per product and shape",
        "",
        "TFLOP/s = 2*M*K*N (backward: twice that) over the median; in parentheses torch's "
        "median over the candidate's.",
    ]
    for product in PRODUCTS:
        entries = [s["products"][product] for s in results["shapes"] if product in s["products"]]
        names = _main_candidates(entries)
        if not names:
            continue
        lines += ["", f"### {product}", ""]
        lines.append("| shape | " + " | ".join(names) + " |")
        lines.append("| --- |" + " --- |" * len(names))
        for s in results["shapes"]:
            entry = s["products"].get(product)
            if entry is None:
                continue
            by_name = {c["name"]: c for c in entry.get("candidates", [])}
            row = [_cell(by_name.get(n)) for n in names]
            if "skipped" in entry:
                row = ["skipped"] * len(names)
            lines.append(f"| {s['shape']['name']} | " + " | ".join(row) + " |")
    lines += [
        "",
        "## Baselines against DESIGN.md (forward; flagged: more than 10% off)",
        "",
        "| shape | candidate | DESIGN.md TFLOP/s | measured | deviation | DESIGN.md ms "
        "| measured ms | difference ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in results["shapes"]:
        entry = s["products"].get("forward")
        if not entry or "candidates" not in entry:
            continue
        for row in design_deviation(s["shape"], entry):
            dev = row["deviation"]
            if dev is None:
                got, dev_cell, ms, diff = row["status"].split(":")[0], "-", "-", "-"
            else:
                got = f"{row['measured']:.1f}"
                dev_cell = f"{dev:+.1%}" + (" **FLAG**" if abs(dev) > 0.10 else "")
                ms = f"{row['measured_ms']:.3f}"
                diff = f"{row['measured_ms'] - row['design_ms']:+.3f}"
            lines.append(
                f"| {s['shape']['name']} | {row['candidate']} | {row['design']} | {got} | "
                f"{dev_cell} | {row['design_ms']:.3f} | {ms} | {diff} |"
            )
    lines += [
        "",
        "## Tile configs of our kernels",
        "",
        "| shape | product | candidate | config | source |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in results["shapes"]:
        for product, entry in s["products"].items():
            for c in entry.get("candidates", []):
                if c["family"] == "ours" and c.get("status") != "derived":
                    config = str(c.get("config", "-")).replace("|", "/")
                    source = c.get("config_source", "-").replace("|", "/")
                    lines.append(
                        f"| {s['shape']['name']} | {product} | {c['name']} | {config} | {source} |"
                    )
    skipped = []
    for s in results["shapes"]:
        if s.get("skipped"):
            skipped.append(f"- {s['shape']['name']}: {s['skipped']}")
            continue
        for product, entry in s["products"].items():
            if "skipped" in entry:
                skipped.append(f"- {s['shape']['name']} {product}: {entry['skipped']}")
            for c in entry.get("candidates", []):
                if c["status"].startswith(("skipped", "deferred")):
                    skipped.append(f"- {s['shape']['name']} {product} {c['name']}: {c['status']}")
    if skipped:
        lines += ["", "## Skipped", "", *skipped]
    for s in results["shapes"]:
        sh = s["shape"]
        gs = s["group_sizes"]
        lines += [
            "",
            f"## {sh['name']}: M={sh['m']}, K={sh['k']}, N={sh['n']}, G={sh['g']}",
            "",
            f"Routing: {s['routing']}; group sizes min {gs['min']}, median {gs['median']:.0f}, "
            f"max {gs['max']}, empty {gs['empty']}. Wall time {s.get('wall_s', '-')} s.",
            "",
            "x torch: torch's median over the candidate's (timed apart); x torch paired: the "
            "median [25th-75th percentile] of torch_i / ours_i over samples timed in "
            "alternation, and torch's median in those pairs.",
            "",
            "| product | candidate | median ms | min-max ms | TFLOP/s | x torch "
            "| x torch paired | status | config |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for product, entry in s["products"].items():
            for c in entry.get("candidates", []):
                t = c.get("timing", {})
                span = f"{t['min_ms']:.3f}-{t['max_ms']:.3f}" if "min_ms" in t else "-"
                tf = f"{c['tflops']:.1f}" if "tflops" in c else "-"
                xt = f"{c['x_torch']:.2f}" if "x_torch" in c else "-"
                name = c["name"] + (" (extra)" if c.get("extra") else "")
                config = str(c.get("config", "")).replace("|", "/")
                if c["family"] == "ours" and config:
                    config = "see 'Tile configs'"
                lines.append(
                    f"| {product} | {name} | {_fmt_ms(c)} | {span} | {tf} | {xt} | "
                    f"{_paired_cell(c)} | {_status_cell(c)} | {config[:160]} |"
                )
    return "\n".join(lines) + "\n"


_WRITE_LOCK = threading.Lock()  # the watchdog's thread writes too


def write_files(out_dir: pathlib.Path, texts: dict[str, str]) -> None:
    """Each {name: text} into out_dir, replaced whole (a run killed while writing leaves the
    previous complete file); one writer at a time (the watchdog's thread writes too)."""
    with _WRITE_LOCK:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            tmp = out_dir / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(out_dir / name)


def write_results(results: dict, out_dir: pathlib.Path) -> None:
    """grouped_gemm_h200.json and .md in out_dir (`write_files`)."""
    write_files(
        out_dir,
        {
            "grouped_gemm_h200.json": json.dumps(results, indent=1, default=str),
            "grouped_gemm_h200.md": render_markdown(results),
        },
    )


def _import_torch(args):
    try:
        import torch  # optional: the GPU image has it, CI does not
    except Exception as e:
        args.torch_missing = f"import torch: {e!r}"
        return None
    if jax.default_backend() == "gpu" and not torch.cuda.is_available():
        args.torch_missing = "torch sees no CUDA device"
        return None
    args.torch_missing = ""
    return torch


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes, our kernels in interpret mode, 2 timed samples",
    )
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--products", default=",".join(PRODUCTS))
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--timed", type=int, default=None, help="timed samples (>= 10 on the GPU)")
    ap.add_argument("--repeats", type=int, default=3, help="runs compared bitwise (>= 3)")
    ap.add_argument("--sample-s", type=float, default=None, help="least time of one sample")
    ap.add_argument(
        "--subset-rows",
        type=int,
        default=256,
        help="rows at each end of a checked group for the reference.py check",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="plan the run to end within this many seconds of --started-at; what does not fit "
        "is skipped and recorded (default 540: one device call of 600 s)",
    )
    ap.add_argument(
        "--started-at",
        type=float,
        default=None,
        help="when the budget started, in seconds since the epoch (bench/grouped_gemm_h200.sh "
        "passes its own start, so the wheel install and imports count); default: this "
        "process's start",
    )
    ap.add_argument(
        "--hard-limit-s",
        type=float,
        default=None,
        help="the watchdog writes the results and exits at this many seconds (default: budget "
        "+ 45 s, inside the device call's 600 s)",
    )
    ap.add_argument(
        "--plan",
        action="store_true",
        help="print the time plan (every step, its tier and estimate) and exit",
    )
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument(
        "--xla-products",
        default="forward,dgrad,wgrad,backward",
        help="products timed for XLA ragged_dot (dgrad and wgrad are tier 3: run when time is "
        "left)",
    )
    ap.add_argument(
        "--configs",
        type=pathlib.Path,
        default=None,
        help="a bench.gmm_sweep sweep.json: time our kernels with its best passing config per "
        "(product, shape) instead of the defaults table",
    )
    ap.add_argument(
        "--paired",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time each of our kernels in alternation with torch (sample i of torch, then "
        "sample i of ours, ...) and report the median of the per-pair ratios beside the ratio "
        "of the medians (default: on)",
    )
    ap.add_argument(
        "--time-failed",
        action="store_true",
        help="also time candidates that fail their check (marked FAILED CHECK)",
    )
    args = ap.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    names = [s for s in args.shapes.split(",") if s]
    unknown = set(names) - {s.name for s in shapes}
    if unknown:
        ap.error(f"unknown shapes {sorted(unknown)}; known: {[s.name for s in shapes]}")
    args.shape_list = [s for s in shapes if not names or s.name in names]
    args.products = [p for p in args.products.split(",") if p]
    args.families = [f for f in args.families.split(",") if f]
    args.xla_products = [x for x in args.xla_products.split(",") if x]
    for value, known, what in (
        (args.xla_products, PRODUCTS, "xla product"),
        (args.products, PRODUCTS, "product"),
        (args.families, FAMILIES, "family"),
    ):
        if set(value) - set(known):
            ap.error(f"unknown {what} {sorted(set(value) - set(known))}; known: {known}")
    args.warmup = (0 if args.smoke else 3) if args.warmup is None else args.warmup
    args.timed = (2 if args.smoke else 10) if args.timed is None else args.timed
    args.sample_s = (0.0 if args.smoke else 0.005) if args.sample_s is None else args.sample_s
    if args.repeats < 1 or args.timed < 1 or args.warmup < 0:
        ap.error(f"{args.repeats=} and {args.timed=} must be >= 1, {args.warmup=} >= 0")
    if not args.smoke and (args.repeats < 3 or args.timed < 10):
        ap.error(
            f"issue 4's method: --repeats >= 3 and --timed >= 10 (got {args.repeats}, "
            f"{args.timed}); --smoke for a quick run"
        )
    if args.budget_s <= 0:
        ap.error(f"--budget-s must be > 0, got {args.budget_s}")
    if args.hard_limit_s is None:
        args.hard_limit_s = args.budget_s + 45.0
    if args.hard_limit_s < args.budget_s:
        ap.error(f"--hard-limit-s {args.hard_limit_s} must be >= --budget-s {args.budget_s}")
    args.sweep_configs = {}
    if args.configs is not None:
        from bench import gmm_sweep  # here: gmm_sweep imports this module

        try:
            args.sweep_configs = gmm_sweep.best_configs(json.loads(args.configs.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--configs {args.configs}: cannot read a sweep's best configs: {e!r}")
    return args


def render_plan(planner: Planner) -> str:
    """The plan as text: one line a step, then the estimate per tier."""
    lines = [f"{'tier':4s} {'est s':>6s}  {'shape':26s} {'product':9s} step"]
    for s in planner.steps:
        lines.append(f"{s.tier:4d} {s.static_s:6.1f}  {s.shape:26s} {s.product:9s} {s.name}")
    summary = planner.summary()
    for tier, t in summary["tiers"].items():
        lines.append(f"tier {tier} ({t['what']}): {t['steps']} steps, ~{t['planned_s']:.0f} s")
    lines.append(
        f"total ~{summary['static_estimate_s']:.0f} s of {planner.budget_s:.0f} s (from the "
        f"device command's start; the table's estimates, before any calibration)"
    )
    return "\n".join(lines)


def run_ceilings(planner: Planner, results: dict, torch_mod) -> None:
    step = planner.step("", "ceilings", "ceilings")
    if step is None:
        return
    skipped = planner.admit(step)
    if skipped is not None:
        results["ceilings"] = {"status": skipped}
        return
    t0 = time.perf_counter()
    try:
        results["ceilings"] = measure_ceilings(torch_mod)
    except Exception as e:
        results["ceilings"] = {"error": repr(e)}
    planner.finish(step, time.perf_counter() - t0)
    print("ceilings:", results["ceilings"], flush=True)


def main(argv: Sequence[str] | None = None, *, started_at: float | None = None) -> dict:
    """Runs the benchmark; the budget counts from --started-at, else `started_at`, else now."""
    args = parse_args(argv)
    if args.started_at is None:
        args.started_at = time.time() if started_at is None else started_at
    torch_mod = _import_torch(args)
    on_gpu = jax.default_backend() == "gpu"
    steps = plan_steps(args, torch_mod, ceilings=(on_gpu or args.plan) and not args.no_ceilings)
    clock = Planner(args.budget_s, steps, started_at=args.started_at)
    if args.plan:
        print(render_plan(clock), flush=True)
        return {"plan": clock.summary(), "steps": [dataclasses.asdict(s) for s in steps]}
    results: dict[str, Any] = {
        "environment": environment(torch_mod, args),
        "method": (
            f"bf16 random data; checked first (vs torch, all elements; vs reference.py f32 on "
            f"the first/middle/last/largest groups; |err| <= 2^-6 (|ref| + rms ref)); "
            f"{args.repeats} runs compared bitwise, and the last timed run against the first; "
            f"{args.warmup} warm-up + 1 calibration call (a call over "
            f"{SLOW_CALL_S * 1e3:.0f} ms: 1 warm-up, no calibration), then median of "
            f"{args.timed} samples of >= {args.sample_s * 1e3:.0f} ms "
            f"(back-to-back calls between two syncs, host clock); TFLOP/s = 2*M*K*N / median"
            + (" (backward: twice that)" if "backward" in args.products else "")
            + f"; XLA ragged_dot timed for {','.join(args.xla_products)}"
            + (
                "; our kernels also timed paired with torch (torch re-timed in alternation: "
                "sample i of torch, then sample i of ours; x torch paired = median of the "
                "per-pair ratios)"
                if args.paired
                else "; no paired timing (--no-paired)"
            )
            + (
                "; SMOKE RUN (tiny shapes, interpret mode): no number here means anything"
                if args.smoke
                else ""
            )
        ),
        "args": {
            k: (str(v) if isinstance(v, pathlib.Path) else v)
            for k, v in vars(args).items()
            if k not in ("shape_list", "sweep_configs")
        },
        "our_configs": {
            "source": f"sweep {args.configs}" if args.configs else "defaults table",
            "from_sweep": {
                f"{product} {shape}": {
                    "label": best["label"],
                    "config": repr(best["config"]),
                    "median_ms_in_sweep": best["median_ms"],
                }
                for (product, shape), best in args.sweep_configs.items()
            },
        },
        "plan": clock.summary(),
        "shapes": [],
    }
    print(json.dumps(results["environment"], indent=1), flush=True)
    for line in render_plan(clock).splitlines()[-(len(TIERS) + 1) :]:
        print("plan:", line, flush=True)

    def save(index: int, shape_result: dict) -> None:
        shapes = results["shapes"]
        shapes[index : index + 1] = [shape_result]  # the shape's own place (appended when new)
        results["elapsed_s"] = round(clock.elapsed(), 1)
        results["plan"] = clock.summary()
        write_results(results, args.out)

    def stop(reason: str) -> None:
        print(reason, flush=True)
        try:
            results["stopped"] = reason
            for _ in range(3):  # the main thread may be changing `results` right now
                try:
                    results["elapsed_s"] = round(clock.elapsed(), 1)
                    results["plan"] = clock.summary()
                    write_results(results, args.out)
                    break
                except RuntimeError:
                    time.sleep(0.2)
        finally:
            os._exit(3)

    watchdog = Watchdog(clock, args.hard_limit_s, stop).start()
    try:
        run_ceilings(clock, results, torch_mod)
        for index, shape in enumerate(args.shape_list):
            save(index, run_problem(shape, args, clock, torch_mod, functools.partial(save, index)))
        again = clock.plan_deferred_again()
        if again:
            print(f"second pass: {sum(map(len, again.values()))} deferred steps", flush=True)
        if "" in again:
            run_ceilings(clock, results, torch_mod)
        for index, shape in enumerate(args.shape_list):
            result, resave = results["shapes"][index], functools.partial(save, index)
            rerun_deferred(shape, args, clock, torch_mod, result, resave, again.get(shape.name, []))
        results["elapsed_s"] = round(clock.elapsed(), 1)
        results["plan"] = clock.summary()
        write_results(results, args.out)
    finally:
        watchdog.cancel()
    print(f"wrote {args.out}/grouped_gemm_h200.{{json,md}} after {clock.elapsed():.0f} s")
    return results


if __name__ == "__main__":
    main(started_at=PROCESS_START)
