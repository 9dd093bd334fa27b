"""Grouped-GEMM benchmark (issue 4): our Mosaic GPU kernels against torch._grouped_mm, tokamax's
mosaic ragged_dot, the jax example Mosaic GPU kernels and jax.lax.ragged_dot, in one process.

The one device command (repository root, device call with `carry: [".whl"]`, timeout 600 s):

    bash bench/grouped_gemm_h200.sh

It installs the carried tokamax wheels, runs this script and copies the results to $OUT.
Locally, on CPU (tiny shapes, our kernels in GPU interpret mode, GPU-only baselines skipped):

    PYTHONPATH=. python -m bench.grouped_gemm_h200 --smoke --out /tmp/gg

What it does, per shape (DESIGN.md's five plus qwen3 gate_up under Zipf routing) and product
(forward, dgrad, wgrad, backward = dgrad + wgrad as autograd runs it, fused SwiGLU):
  1. bf16 random inputs on the device (x ~ N(0, 1), w ~ N(0, 1/K), dout ~ N(0, 1)); torch
     sees the same buffers through DLPack.
  2. Each candidate runs once and is checked: against torch's result (all elements) and against
     `pallas_kernels/grouped_matmul/reference.py` in f32 on a few groups (first/last rows of the
     first, middle, last and largest groups; whole groups for the weight gradient). Pass:
     finite, and |out - ref| <= 2^-6 * (|ref| + rms(ref)) elementwise.
  3. Two more runs on the same inputs; the three outputs are compared bitwise.
  4. Timing: warm-up, then >= 10 timed samples; a sample is `reps` back-to-back calls between
     two device synchronizations (host clock), divided by `reps` (reps makes a sample >= ~5 ms
     so launch and sync overhead stay out; the same method for JAX and torch). Median, min, max.
  TFLOP/s counts 2*M*K*N (M = routed rows; backward counts twice that); ratio = torch time /
  candidate time (> 1: faster than torch).
A candidate that cannot be imported or built is reported as "not available: <reason>"; one that
fails its check is not timed. Results: bench/results/grouped_gemm_h200.{json,md}, rewritten
after every shape so a run cut short still leaves its numbers.
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
    config: str = ""
    config_source: str = ""  # where `config` came from (ours: defaults table or a sweep)


def _as_tuple(out) -> tuple[jax.Array, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


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

            cands.append(Candidate("ours triton.gmm", "ours", triton_build, extra=True))
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

        config = self.tokamax_config
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
        s = self.p.shape
        widths = s.k + s.n + (s.k if product == "backward" else 0)
        need = s.g * s.m * widths * 2
        available = _jax_memory_available()
        if available is not None and need > available:
            raise NotAvailable(
                f"XLA's {product} builds dense per-group operands of {need / 2**30:.0f} GiB "
                f"(G*M*{widths} bf16), {available / 2**30:.0f} GiB free for JAX (it ran out of "
                "memory in XLA's autotuner at this shape on 2026-11-30)"
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


def full_reference(p: Problem, product: str) -> tuple[jax.Array, ...]:
    """All elements of the expected result without torch: XLA ragged_dot (bf16 products, f32
    accumulation) and reference.tgmm in f32."""
    f32 = jnp.float32
    rd = functools.partial(jax.lax.ragged_dot, preferred_element_type=f32)
    if product == "forward":
        return (rd(p.x, p.w, p.gs),)
    if product == "dgrad":
        return (rd(p.dout, jnp.swapaxes(p.w, 1, 2), p.gs),)
    if product == "wgrad":
        return (reference.tgmm(p.x, p.dout, p.gs),)
    if product == "backward":
        return (rd(p.dout, jnp.swapaxes(p.w, 1, 2), p.gs), reference.tgmm(p.x, p.dout, p.gs))
    if product == "swiglu":
        return (jax.nn.silu(rd(p.x, p.w_gate, p.gs)) * rd(p.x, p.w_up, p.gs),)
    raise ValueError(product)


_ref_gmm = jax.jit(reference.gmm, static_argnames="transpose_rhs")
_ref_tgmm = jax.jit(reference.tgmm)
_ref_swiglu = jax.jit(reference.gmm_swiglu)
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


def time_runner(runner: Runner, *, warmup: int, timed: int, target_sample_s: float) -> dict:
    out = None
    for _ in range(warmup):
        out = runner.call()
        runner.sync(out)
    t0 = time.perf_counter()
    out = runner.call()
    runner.sync(out)
    single_s = time.perf_counter() - t0
    reps = max(1, min(50, round(target_sample_s / max(single_s, 1e-9))))
    samples = []
    for _ in range(timed):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = runner.call()
        runner.sync(out)
        samples.append((time.perf_counter() - t0) / reps * 1e3)
    del out
    return {
        "median_ms": float(np.median(samples)),
        "min_ms": float(np.min(samples)),
        "max_ms": float(np.max(samples)),
        "reps_per_sample": reps,
        "samples": timed,
        "warmup": warmup + 1,
        "samples_ms": [round(s, 5) for s in samples],
    }


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
    def __init__(self, budget_s: float):
        self.t0, self.budget_s = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def allows_anything(self) -> bool:
        return self.elapsed() < self.budget_s

    def allows(self, cand: Candidate) -> bool:
        # Extras go first when time runs short: they stop at 70% of the budget.
        limit = self.budget_s * (0.7 if cand.extra else 1.0)
        return self.elapsed() < limit


def run_candidate(
    cand: Candidate, *, product, full, subsets, sizes, args, clock
) -> tuple[dict, tuple]:
    """Build, check, repeat (bitwise), time. Returns the record and the checked outputs."""
    rec: dict[str, Any] = {"name": cand.name, "family": cand.family, "extra": cand.extra}
    if cand.config:
        rec["config"] = cand.config
    if cand.config_source:
        rec["config_source"] = cand.config_source
    if not clock.allows(cand):
        rec["status"] = f"skipped: time budget ({clock.elapsed():.0f} s of {clock.budget_s:.0f})"
        return rec, ()
    t_start = time.perf_counter()
    try:
        runner = cand.build()
    except NotAvailable as e:
        rec["status"] = f"not available: {e}"
        return rec, ()
    except Exception as e:  # a candidate that raises is reported, not fatal
        rec["status"] = f"not available: {type(e).__name__}: {e}"[:1500]
        rec["traceback"] = traceback.format_exc()[-3000:]
        return rec, ()
    rec["compile_s"] = round(runner.compile_s, 3)
    rec.update(runner.info)
    outs: tuple = ()
    try:
        first = runner.call()
        runner.sync(first)
        outs = runner.to_jax(first)
        rec["check"] = check(outs, full, subsets, sizes)
        same = True
        for _ in range(args.repeats - 1):
            again = runner.to_jax(runner.call())
            same &= all(bool(_bits_equal(a, b)) for a, b in zip(outs, again, strict=True))
            del again
        rec["bitwise_repeatable"] = {"runs": args.repeats, "identical": bool(same)}
        if not rec["check"]["ok"] and not args.time_failed:
            rec["status"] = "failed check (not timed)"
            return rec, outs
        rec["timing"] = time_runner(
            runner, warmup=args.warmup, timed=args.timed, target_sample_s=args.sample_s
        )
        rec["status"] = "ok" if rec["check"]["ok"] else "FAILED CHECK (timed: --time-failed)"
    except Exception as e:
        rec["status"] = f"error: {type(e).__name__}: {e}"[:1500]
        rec["traceback"] = traceback.format_exc()[-3000:]
    rec["wall_s"] = round(time.perf_counter() - t_start, 2)
    rec["t_end_s"] = round(clock.elapsed(), 1)
    return rec, outs


def run_problem(shape: Shape, args, clock: Clock, torch_mod, save: Callable[[dict], None]) -> dict:
    """All products of one shape; `save(partial_result)` after each product."""
    t0 = time.perf_counter()
    p = make_problem(shape, torch_mod)
    bench = Bench(args, p)
    sizes = p.sizes
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
        f"group sizes {result['group_sizes']}",
        flush=True,
    )
    for product in args.products:
        if product == "swiglu" and not shape.gate_up:
            continue
        if not clock.allows_anything():
            result["products"][product] = {"skipped": f"time budget ({clock.elapsed():.0f} s)"}
            continue
        flops, nbytes = product_cost(shape, product)
        subsets = subset_reference(p, product, cap=args.subset_rows)
        entry: dict[str, Any] = {"flops": flops, "min_bytes_bf16_out": nbytes, "candidates": []}
        full, entry["full_reference"] = None, "torch"
        for cand in bench.candidates(product):
            if full is None and cand.family != "torch":
                # torch did not run (or failed its check): XLA in f32 checks all elements.
                full = full_reference(p, product)
                entry["full_reference"] = "xla ragged_dot / reference.tgmm in f32 (no torch)"
            rec, outs = run_candidate(
                cand,
                product=product,
                full=full,
                subsets=subsets,
                sizes=p.sizes,
                args=args,
                clock=clock,
            )
            rec.setdefault("t_end_s", round(clock.elapsed(), 1))
            if cand.family == "torch" and rec.get("check", {}).get("ok"):
                full = outs  # torch's result: the all-elements reference of the others
            del outs
            if "timing" in rec:
                rec["tflops"] = flops / (rec["timing"]["median_ms"] * 1e-3) / 1e12
            entry["candidates"].append(rec)
            torch_ms = next(
                (
                    c["timing"]["median_ms"]
                    for c in entry["candidates"]
                    if c["family"] == "torch" and "timing" in c
                ),
                None,
            )
            _print_rec(product, rec, torch_ms)
        _ratios(entry)
        if product == "backward":
            _derive_ours_backward(result["products"], entry)
        result["products"][product] = entry
        del full
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        save(result)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    del p, bench
    if torch_mod is not None and jax.default_backend() == "gpu":
        torch_mod.cuda.empty_cache()
    return result


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
    """Our backward as dgrad + wgrad (bf16 out) when no custom_vjp ran."""
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
    for c in entry["candidates"]:
        if c["name"] == name and "timing" in c:
            return c
    return None


def _print_rec(product: str, rec: dict, torch_ms: float | None) -> None:
    when = f"t={rec.get('t_end_s', 0):.0f}s"
    if "timing" in rec:
        t = rec["timing"]
        ratio = f" {torch_ms / t['median_ms']:.2f}x torch" if torch_ms else ""
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


def _status_cell(c: dict) -> str:
    bits = ""
    if "bitwise_repeatable" in c:
        same = "yes" if c["bitwise_repeatable"]["identical"] else "**NO**"
        bits = f"; bitwise x{c['bitwise_repeatable']['runs']}: {same}"
    if c.get("check", {}).get("ok") is False and "parts" in c["check"]:
        worst = [
            f"rel {v['rel_fro']:.1e} vs {k.removeprefix('vs_')}"
            for part in c["check"]["parts"]
            for k, v in part.items()
            if isinstance(v, dict) and not v.get("ok", True) and "rel_fro" in v
        ]
        return f"**{c['status']}**: " + ", ".join(worst[:2]) + bits
    if "timing" in c:
        return "ok" + bits
    return c["status"].replace("|", "/")[:200]


def design_deviation(shape: dict, entry: dict) -> list[dict]:
    rows = []
    for c in entry["candidates"]:
        want = shape["design_tflops"].get(c["name"])
        if want is None:
            continue
        got = c.get("tflops")
        dev = None if got is None else (got - want) / want
        rows.append({"candidate": c["name"], "design": want, "measured": got, "deviation": dev})
    return rows


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
            f"- our kernels' tile configs: {ours['source']}"
            + "".join(
                f"; {pair}: {best['label']}" for pair, best in ours.get("from_sweep", {}).items()
            )
        )
    if results.get("ceilings"):
        c = results["ceilings"]
        lines.append(
            "- ceilings measured in this run: "
            + ", ".join(f"{k} = {v:.1f}" for k, v in c.items() if isinstance(v, float))
        )
    lines += ["", "## Targets (ours against torch, measured side by side)", ""]
    lines += [
        "| shape | forward x torch (>= 1.0) | dgrad x torch (>= 0.9) | wgrad x torch (>= 0.9) "
        "| backward x torch | swiglu x torch | bitwise x3 (all ours) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    want = {"forward": 1.0, "dgrad": 0.9, "wgrad": 0.9, "backward": None, "swiglu": None}
    main = {
        "forward": "ours mosaic_gpu.gmm",
        "dgrad": "ours mosaic_gpu.gmm(transpose_rhs)",
        "wgrad": "ours tgmm (bf16 out)",
        "backward": None,
        "swiglu": "ours mosaic_gpu.gmm_swiglu",
    }
    for s in results["shapes"]:
        cells, bits = [], []
        for product in PRODUCTS:
            entry = s["products"].get(product)
            if entry is None or "candidates" not in entry:
                cells.append("-" if entry is None else "skipped (time)")
                continue
            ours = [c for c in entry["candidates"] if c["family"] == "ours" and not c["extra"]]
            if main[product]:
                ours = [c for c in ours if c["name"] == main[product]] or ours
            timed = [c for c in ours if "x_torch" in c]
            if timed:
                best = max(timed, key=lambda c: c["x_torch"])
                mark = ""
                if want[product] is not None:
                    mark = " (met)" if best["x_torch"] >= want[product] else " (**missed**)"
                cells.append(f"{best['x_torch']:.2f}x{mark}")
            else:
                cells.append(ours[0]["status"].split(":")[0] if ours else "-")
            for c in entry["candidates"]:
                if c["family"] == "ours" and "bitwise_repeatable" in c:
                    bits.append(c["bitwise_repeatable"]["identical"])
        bit_cell = "-" if not bits else ("yes" if all(bits) else "**NO**")
        lines.append(f"| {s['shape']['name']} | " + " | ".join(cells) + f" | {bit_cell} |")
    lines += ["", "## Baselines against DESIGN.md (forward TFLOP/s; flag: more than 10% off)", ""]
    lines += [
        "| shape | candidate | DESIGN.md | measured | deviation |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in results["shapes"]:
        entry = s["products"].get("forward")
        if not entry or "candidates" not in entry:
            continue
        for row in design_deviation(s["shape"], entry):
            got = "-" if row["measured"] is None else f"{row['measured']:.1f}"
            dev = row["deviation"]
            dev_cell = (
                "-" if dev is None else f"{dev:+.0%}" + (" **FLAG**" if abs(dev) > 0.10 else "")
            )
            lines.append(
                f"| {s['shape']['name']} | {row['candidate']} | {row['design']} | "
                f"{got} | {dev_cell} |"
            )
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
            "| product | candidate | median ms | min-max ms | TFLOP/s | x torch | status "
            "| config |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for product, entry in s["products"].items():
            for c in entry.get("candidates", []):
                t = c.get("timing", {})
                span = f"{t['min_ms']:.3f}-{t['max_ms']:.3f}" if "min_ms" in t else "-"
                tf = f"{c['tflops']:.1f}" if "tflops" in c else "-"
                xt = f"{c['x_torch']:.2f}" if "x_torch" in c else "-"
                name = c["name"] + (" (extra)" if c.get("extra") else "")
                config = c.get("config", "").replace("|", "/")[:160]
                lines.append(
                    f"| {product} | {name} | {_fmt_ms(c)} | {span} | {tf} | {xt} | "
                    f"{_status_cell(c)} | {config} |"
                )
    return "\n".join(lines) + "\n"


def _save_partial(results: dict, index: int, clock, out_dir: pathlib.Path, shape: dict) -> None:
    results["shapes"][index:] = [shape]
    results["elapsed_s"] = round(clock.elapsed(), 1)
    write_results(results, out_dir)


def write_results(results: dict, out_dir: pathlib.Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "grouped_gemm_h200.json").write_text(json.dumps(results, indent=1, default=str))
    (out_dir / "grouped_gemm_h200.md").write_text(render_markdown(results))


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
    ap.add_argument("--repeats", type=int, default=3, help="runs compared bitwise")
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
        help="stop starting candidates after this many seconds (extras at 70%%)",
    )
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument(
        "--xla-products",
        default="forward,backward",
        help="products timed for XLA ragged_dot (its dgrad/wgrad alone cost ~1 min a shape)",
    )
    ap.add_argument(
        "--configs",
        type=pathlib.Path,
        default=None,
        help="a bench.gmm_sweep sweep.json: time our kernels with its best passing config per "
        "(product, shape) instead of the defaults table",
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
    args.sweep_configs = {}
    if args.configs is not None:
        from bench import gmm_sweep  # here: gmm_sweep imports this module

        try:
            args.sweep_configs = gmm_sweep.best_configs(json.loads(args.configs.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--configs {args.configs}: cannot read a sweep's best configs: {e!r}")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    clock = Clock(args.budget_s)
    torch_mod = _import_torch(args)
    results: dict[str, Any] = {
        "environment": environment(torch_mod, args),
        "method": (
            f"bf16 random data; checked first (vs torch, all elements; vs reference.py f32 on "
            f"the first/middle/last/largest groups; |err| <= 2^-6 (|ref| + rms ref)); "
            f"{args.repeats} runs compared bitwise; {args.warmup} warm-up + 1 calibration "
            f"call, then median of {args.timed} samples of >= {args.sample_s * 1e3:.0f} ms "
            f"(back-to-back calls between two syncs, host clock); TFLOP/s = 2*M*K*N / median"
            + (" (backward: twice that)" if "backward" in args.products else "")
            + f"; XLA ragged_dot timed for {','.join(args.xla_products)} only"
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
        "shapes": [],
    }
    print(json.dumps(results["environment"], indent=1), flush=True)
    if jax.default_backend() == "gpu" and not args.no_ceilings:
        try:
            results["ceilings"] = measure_ceilings(torch_mod)
        except Exception as e:
            results["ceilings"] = {"error": repr(e)}
        print("ceilings:", results["ceilings"], flush=True)
    for shape in args.shape_list:
        if not clock.allows_anything():
            results.setdefault("shapes_skipped", []).append(shape.name)
            continue
        save = functools.partial(_save_partial, results, len(results["shapes"]), clock, args.out)
        save(run_problem(shape, args, clock, torch_mod, save))
    write_results(results, args.out)
    print(f"wrote {args.out}/grouped_gemm_h200.{{json,md}} after {clock.elapsed():.0f} s")
    return results


if __name__ == "__main__":
    main()
