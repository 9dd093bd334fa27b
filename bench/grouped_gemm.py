"""Grouped GEMM: our Mosaic GPU kernels against torch._grouped_mm, tokamax's mosaic ragged_dot,
the jax example Mosaic GPU kernels and jax.lax.ragged_dot, in one process, each checked first.

    python -m bench.grouped_gemm --out DIR [--shapes qwen3_gate_up,...] [--products forward,...]
        [--families torch,ours,...] [--configs SWEEP/sweep.json] [--budget-s S]
    python -m bench.grouped_gemm --smoke --out DIR     # CPU: tiny shapes, interpret mode

bench/README.md describes the shapes, products, candidates, check and tables. Inputs: bf16 on
the device, x ~ N(0, 1), w ~ N(0, 1/K), dout ~ N(0, 1), torch reading the same buffers through
DLPack; uniform routing is a multinomial of M rows over G groups (seed 0), Zipf routing rounds
by largest remainder and shuffles the groups. The reference.py check covers --subset-rows rows
at each end of a checked group (whole groups for wgrad). Writes DIR/grouped_gemm.{json,md},
rewritten after every candidate.
"""

from __future__ import annotations

import os

# torch shares the GPU with JAX in this process: JAX must not take 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.80")

import argparse
import dataclasses
import functools
import importlib
import inspect
import json
import math
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness as h
from pallas_kernels.grouped_matmul import reference
from pallas_kernels.grouped_matmul.tuning import TileConfig

NAME = "grouped_gemm"
ZIPF_EXPONENT = 1.2
SEED = 0
TOL = 2.0**-6  # bf16 outputs: relative to |ref| plus the reference's rms
PRODUCTS = ("forward", "dgrad", "wgrad", "backward", "swiglu")
FAMILIES = ("torch", "ours", "tokamax", "jax_example", "xla")
# jax example kernel tiles: DESIGN.md's "128x128x64, 4 stages".
JAX_EXAMPLE_TILES = dict(
    block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1
)
# The outputs of a product, each checked against the reference part of that name.
PARTS = {
    "forward": ("forward",),
    "dgrad": ("dgrad",),
    "wgrad": ("wgrad",),
    "backward": ("dgrad", "wgrad"),
    "swiglu": ("swiglu",),
}
TARGETS = {"forward": 1.0, "dgrad": 0.9, "wgrad": 0.9, "backward": None, "swiglu": None}
MAIN = {  # our candidate each product's target is judged on
    "forward": "ours mosaic_gpu.gmm",
    "dgrad": "ours mosaic_gpu.gmm(transpose_rhs)",
    "wgrad": "ours tgmm (bf16 out)",
    "backward": "ours ops.gmm backward (custom_vjp)",
    "swiglu": "ours mosaic_gpu.gmm_swiglu",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """One grouped GEMM: M routed rows of width K, G groups of [K, N] weights."""

    name: str
    m: int
    k: int
    n: int
    g: int
    routing: str  # "uniform" or "zipf"
    gate_up: bool  # N holds gate and up side by side: also time the fused SwiGLU (F = N / 2)
    design_tflops: dict[str, float]  # DESIGN.md's measured forward TFLOP/s, by candidate name


def _design(xla, tokamax, example, torch):
    return {"xla ragged_dot": xla, "tokamax mosaic": tokamax, "jax example mgpu": example,
            "torch._grouped_mm": torch}  # fmt: skip


SHAPES: tuple[Shape, ...] = (
    Shape(name="qwen3_gate_up", m=131072, k=2048, n=1536, g=128, routing="uniform",
          gate_up=True, design_tflops=_design(4.9, 280, 298, 655)),
    Shape(name="qwen3_down", m=131072, k=768, n=2048, g=128, routing="uniform", gate_up=False,
          design_tflops=_design(5.9, 261, 217, 556)),
    Shape(name="mixtral_gate_up", m=16384, k=4096, n=28672, g=8, routing="uniform",
          gate_up=True, design_tflops=_design(96, 261, 455, 637)),
    Shape(name="dsv3_ep8_gate_up", m=32768, k=7168, n=4096, g=32, routing="uniform",
          gate_up=True, design_tflops=_design(24, 288, 421, 618)),
    Shape(name="dsv3_ep8_down", m=32768, k=2048, n=7168, g=32, routing="uniform",
          gate_up=False, design_tflops=_design(25, 284, 371, 561)),
    Shape(name=f"qwen3_gate_up_zipf{ZIPF_EXPONENT}", m=131072, k=2048, n=1536, g=128,
          routing="zipf", gate_up=True, design_tflops={}),
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


@dataclasses.dataclass
class Problem:
    """One shape's inputs (JAX on the device, torch views of the same buffers in `t`)."""

    shape: Shape
    sizes: np.ndarray
    x: jax.Array  # [M, K] bf16
    w: jax.Array  # [G, K, N] bf16
    dout: jax.Array  # [M, N] bf16
    gs: jax.Array  # [G] int32
    w_gate: jax.Array | None  # [G, K, N/2] (gate_up shapes)
    w_up: jax.Array | None
    torch: Any = None
    t: dict = dataclasses.field(default_factory=dict)
    subsets: dict = dataclasses.field(default_factory=dict)  # reference parts, by name


def make_problem(shape: Shape, torch) -> Problem:
    sizes = group_sizes_for(shape)
    kx, kw, kd = jax.random.split(jax.random.key(SEED), 3)
    x = jax.random.normal(kx, (shape.m, shape.k), jnp.bfloat16)
    w = jax.random.normal(kw, (shape.g, shape.k, shape.n), jnp.bfloat16)
    w = w * jnp.bfloat16(1.0 / math.sqrt(shape.k))
    dout = jax.random.normal(kd, (shape.m, shape.n), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    f = shape.n // 2
    w_gate, w_up = (w[:, :, :f], w[:, :, f:]) if shape.gate_up else (None, None)
    jax.block_until_ready((x, w, dout, gs, w_gate, w_up))
    p = Problem(shape, sizes, x, w, dout, gs, w_gate, w_up, torch=torch)
    if torch is not None:
        view = torch.from_dlpack
        p.t = {"x": view(x), "w": view(w), "dout": view(dout)}
        p.t["offs"] = view(jnp.cumsum(gs).astype(jnp.int32))
        if shape.gate_up:
            p.t["w_gate"], p.t["w_up"] = view(w_gate), view(w_up)
    return p


# ---------------------------------------------------------------------------------------------
# References and the check

_ref_jit = functools.partial(jax.jit, compiler_options=h.REFERENCE_COMPILER_OPTIONS)
_ref_gmm = _ref_jit(reference.gmm, static_argnames="transpose_rhs")
_ref_tgmm = _ref_jit(reference.tgmm)
_ref_swiglu = _ref_jit(reference.gmm_swiglu)
_ref_ragged_dot = _ref_jit(
    functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32)
)


def full_reference(p: Problem, product: str) -> tuple[jax.Array, ...]:
    """Every element of the expected result without torch: XLA ragged_dot (bf16 products, f32
    accumulation) and reference.tgmm in f32."""
    rd = _ref_ragged_dot
    parts = {
        "forward": lambda: rd(p.x, p.w, p.gs),
        "dgrad": lambda: rd(p.dout, jnp.swapaxes(p.w, 1, 2), p.gs),
        "wgrad": lambda: _ref_tgmm(p.x, p.dout, p.gs),
        "swiglu": lambda: jax.nn.silu(rd(p.x, p.w_gate, p.gs)) * rd(p.x, p.w_up, p.gs),
    }
    return tuple(parts[name]() for name in PARTS[product])


@dataclasses.dataclass(frozen=True)
class Subset:
    """The reference on a few groups: rows (of [M, *] outputs) or groups (of [G, K, N])."""

    index: np.ndarray
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
        r = np.arange(int(starts[g]), int(starts[g]) + int(sizes[g]))
        if cap is not None and len(r) > 2 * cap:
            r = np.concatenate([r[:cap], r[-cap:]])
        rows.append(r)
        counts.append(len(r))
    return np.concatenate(rows).astype(np.int64), np.array(counts, dtype=np.int32)


def subset_reference(p: Problem, product: str, *, cap: int) -> tuple[Subset, ...]:
    """reference.py in f32 on a few groups; each part computed once per problem (backward
    reuses dgrad's and wgrad's)."""
    groups = pick_groups(p.sizes)
    g = jnp.asarray(groups)

    def part(name: str) -> Subset:
        if name == "wgrad":
            rows, counts = group_rows(p.sizes, groups, cap=None)
            r = jnp.asarray(rows)
            return Subset(groups, _ref_tgmm(p.x[r], p.dout[r], jnp.asarray(counts)))
        rows, counts = group_rows(p.sizes, groups, cap=cap)
        r, c = jnp.asarray(rows), jnp.asarray(counts)
        if name == "forward":
            ref = _ref_gmm(p.x[r], p.w[g], c)
        elif name == "dgrad":
            ref = _ref_gmm(p.dout[r], p.w[g], c, transpose_rhs=True)
        else:
            ref = _ref_swiglu(p.x[r], p.w_gate[g], p.w_up[g], c)
        return Subset(rows, ref)

    for name in PARTS[product]:
        if name not in p.subsets:
            p.subsets[name] = part(name)
    return tuple(p.subsets[name] for name in PARTS[product])


compare = functools.partial(h.compare, rtol=TOL, atol=TOL, scale="rms")


@jax.jit
def _excess_by_group(out, ref, group_of_row):
    """Per group, the largest |out - ref| - TOL |ref| over its elements, in units of rms(ref)."""
    o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
    excess = (jnp.abs(o - r) - TOL * jnp.abs(r)) / (jnp.sqrt(jnp.mean(r * r)) + 1e-30)
    if out.ndim == 3:  # [G, K, N]
        return jnp.max(excess, axis=(1, 2))
    per_row = jnp.max(excess, axis=1)
    return jax.ops.segment_max(per_row, group_of_row, num_segments=group_of_row.shape[0])


def failure_detail(out: jax.Array, ref: jax.Array, sizes: np.ndarray) -> dict:
    """Which groups fail a failed check: their count, the first few, their sizes."""
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


def check(outs: tuple, full: tuple | None, subsets: tuple[Subset, ...], sizes) -> dict:
    """Each output against the full reference (if any) and its reference.py subset."""
    if len(outs) != len(subsets):
        return {"ok": False, "why": f"{len(outs)} outputs, expected {len(subsets)}"}
    result: dict[str, Any] = {"ok": True, "parts": []}
    for i, (out, subset) in enumerate(zip(outs, subsets, strict=True)):
        part: dict[str, Any] = {}
        if full is not None:
            part["vs_full_reference"] = compare(out, full[i])
            if not part["vs_full_reference"]["ok"]:
                part["vs_full_reference"]["detail"] = failure_detail(out, full[i], sizes)
        part["vs_reference_subset"] = compare(out[jnp.asarray(subset.index)], subset.ref)
        part["ok"] = all(c["ok"] for c in part.values())
        result["parts"].append(part)
        result["ok"] &= part["ok"]
    return result


# ---------------------------------------------------------------------------------------------
# Candidates


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    family: str  # one of FAMILIES
    build: Callable[[], h.Runner]
    extra: bool = False  # not a target row: skipped first when the budget runs short
    config: str | Callable[[], str] = ""  # a callable is described when the candidate runs
    config_source: str = ""  # where `config` came from (ours: defaults table or a sweep)


def _kwargs_accepted(fn: Callable, **kwargs) -> dict:
    params = inspect.signature(fn).parameters
    return {key: value for key, value in kwargs.items() if key in params}


def _ours(module: str):
    try:
        return importlib.import_module(f"pallas_kernels.grouped_matmul.{module}")
    except Exception as e:  # any import failure means "not available"
        raise h.NotAvailable(f"import pallas_kernels.grouped_matmul.{module}: {e!r}") from e


def xla_dense_bytes(s: Shape, product: str) -> int:
    """Bytes of the dense per-group operands XLA:GPU builds for the ragged-contracting dot."""
    return s.g * s.m * (s.k + s.n + (s.k if product == "backward" else 0)) * 2


class Bench:
    """The candidates of each product for one problem."""

    def __init__(self, args, problem: Problem):
        self.args, self.p = args, problem
        self.interpret = args.smoke and jax.default_backend() != "gpu"
        self.on_gpu = jax.default_backend() == "gpu"

    def candidates(self, product: str) -> list[Candidate]:
        out = []
        for family in FAMILIES:
            if family in self.args.families:
                out += getattr(self, f"{family}_candidates")(product)
        return out  # xla last: the slowest, and it grows JAX's memory pool

    def _vjp_runner(self, f: Callable) -> h.Runner:
        """The backward alone: jax.vjp once (residuals), then the jitted pullback of dout."""
        _, pullback = jax.vjp(f, self.p.x, self.p.w)
        return h.jax_runner(lambda pb, d: pb(d), pullback, self.p.dout)

    def torch_candidates(self, product: str) -> list[Candidate]:
        p, t = self.p, self.p.t
        gmm = getattr(p.torch, "_grouped_mm", None)

        def build(make_fn):
            def b():
                if p.torch is None:
                    raise h.NotAvailable(self.args.torch_missing)
                return h.torch_runner(p.torch, make_fn(), on_gpu=self.on_gpu)

            return b

        def backward():
            x = t["x"].detach().requires_grad_(True)
            w = t["w"].detach().requires_grad_(True)
            with p.torch.enable_grad():
                out = gmm(x, w, offs=t["offs"])
            return lambda: p.torch.autograd.grad(out, (x, w), t["dout"], retain_graph=True)

        def swiglu():
            silu, x, offs = p.torch.nn.functional.silu, t["x"], t["offs"]
            return lambda: silu(gmm(x, t["w_gate"], offs=offs)) * gmm(x, t["w_up"], offs=offs)

        fns = {
            "forward": (lambda: lambda: gmm(t["x"], t["w"], offs=t["offs"]),
                        "x [M,K] row-major, w [G,K,N] row-major"),
            "dgrad": (lambda: lambda: gmm(t["dout"], t["w"].transpose(-2, -1), offs=t["offs"]),
                      "dout [M,N], w.transpose(-2,-1) (a column-major view, no copy)"),
            "wgrad": (lambda: lambda: gmm(t["x"].t(), t["dout"], offs=t["offs"]),
                      "x.t() (a column-major view) x dout [M,N] -> [G,K,N]"),
            "backward": (backward, "autograd.grad of torch._grouped_mm (retain_graph)"),
            "swiglu": (swiglu, "two grouped mms, then silu(gate) * up in bf16"),
        }  # fmt: skip
        names = {"backward": "torch autograd backward", "swiglu": "torch 2x _grouped_mm + silu*up"}
        make_fn, layout = fns[product]
        return [Candidate(names.get(product, "torch._grouped_mm"), "torch", build(make_fn),
                          config=layout)]  # fmt: skip

    def ours_config(self, product: str, *, use_sweep: bool = True) -> tuple[Any, str, str]:
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
        source = "defaults table (config=None)"
        try:
            if product == "wgrad":
                return (
                    None,
                    repr(_ours("mosaic_gpu_wgrad").default_config(shape.k, shape.n)),
                    source,
                )
            n = {"forward": shape.n, "dgrad": shape.k, "swiglu": shape.n // 2}[product]
            config = _ours("mosaic_gpu").default_config(
                n=n, transpose_rhs=product == "dgrad", swiglu=product == "swiglu",
                interpret=self.interpret,
            )  # fmt: skip
            return None, repr(config), source
        except Exception as e:  # the record says what it could not tell
            return None, f"could not describe it: {e!r}"[:300], source

    def ours_candidates(self, product: str) -> list[Candidate]:
        p, interp = self.p, {"interpret": True} if self.interpret else {}

        def build(module: str, fn_name: str, *operands, **kw):
            def b():
                mod = _ours(module)
                fn = getattr(mod, fn_name)
                return h.jax_runner(functools.partial(fn, **kw, **interp), *operands, p.gs)

            return b

        if product == "backward":

            def ops_build():
                ops = _ours("ops")
                fn = functools.partial(ops.gmm, **_kwargs_accepted(ops.gmm, **interp))
                return self._vjp_runner(lambda a, b: fn(a, b, p.gs))

            described = lambda: (  # noqa: E731
                f"dgrad: {self.ours_config('dgrad', use_sweep=False)[1]}; "
                f"wgrad: {self.ours_config('wgrad', use_sweep=False)[1]}"
            )
            source = "defaults table (ops.gmm takes no config)"
            return [Candidate(MAIN["backward"], "ours", ops_build, config=described,
                              config_source=source)]  # fmt: skip
        config, described, source = self.ours_config(product)
        kw = {"config": config} if config is not None else {}

        def ours(build_fn, **more):
            return Candidate(MAIN[product], "ours", build_fn, config=described,
                             config_source=source, **more)  # fmt: skip

        if product == "forward":

            def triton_build():
                mod = _ours("triton")
                fn = functools.partial(mod.gmm, **_kwargs_accepted(mod.gmm, **interp))
                return h.jax_runner(fn, p.x, p.w, p.gs)

            triton = Candidate(
                "ours triton.gmm", "ours", triton_build, extra=True,
                config=lambda: repr(_ours("triton").TritonTileConfig()),
                config_source="TritonTileConfig's defaults (config=None)",
            )  # fmt: skip
            return [ours(build("mosaic_gpu", "gmm", p.x, p.w, **kw)), triton]
        if product == "dgrad":
            return [ours(build("mosaic_gpu", "gmm", p.dout, p.w, transpose_rhs=True, **kw))]
        if product == "swiglu":
            return [ours(build("mosaic_gpu", "gmm_swiglu", p.x, p.w_gate, p.w_up, **kw))]
        tgmm = functools.partial(build, "mosaic_gpu_wgrad", "tgmm", p.x, p.dout)
        return [
            ours(tgmm(out_dtype=jnp.bfloat16, **kw)),
            Candidate(
                "ours tgmm (f32 out)", "ours", tgmm(out_dtype=jnp.float32), extra=True,
                config=self.ours_config("wgrad", use_sweep=False)[1],
                config_source="defaults table (config=None; a sweep's bf16-out config is not "
                "applied to the f32 output)",
            ),
        ]  # fmt: skip

    @functools.cached_property
    def tokamax_config(self) -> str:
        try:
            h.import_tokamax()
            from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu

            op = pallas_mosaic_gpu.PallasMosaicGpuRaggedDot()
            bound = op.bind(self.p.x, self.p.w, group_sizes=self.p.gs)
            return f"default_config (heuristics unless cached): {bound.default_config!r}"
        except Exception as e:
            return f"could not describe: {e!r}"[:300]

    def tokamax_candidates(self, product: str) -> list[Candidate]:
        p = self.p
        config = lambda: self.tokamax_config  # noqa: E731 (described when it runs)
        dims = {
            "forward": (p.x, p.w, "DEFAULT_RAGGED_DOT_DIM_NUMS"),
            "dgrad": (p.dout, p.w, "TRANS_RHS_RAGGED_DOT_DIM_NUMS"),
            "wgrad": (p.x, p.dout, "RAGGED_CONTRACTING_DOT_DIM_NUMS"),
        }
        if product in dims:
            lhs, rhs, dims_name = dims[product]

            def build():
                tokamax, base = h.import_tokamax()
                fn = functools.partial(
                    tokamax.ragged_dot_general,
                    ragged_dot_dimension_numbers=getattr(base, dims_name),
                    preferred_element_type=jnp.bfloat16,
                    implementation="mosaic",
                )
                return h.jax_runner(lambda a, b, g: fn(a, b, g), lhs, rhs, p.gs)

            return [Candidate("tokamax mosaic", "tokamax", build, config=config)]
        if product == "backward":

            def vjp_build():
                tokamax, _ = h.import_tokamax()
                rd = functools.partial(tokamax.ragged_dot, implementation="mosaic")
                return self._vjp_runner(lambda a, b: rd(a, b, p.gs))

            return [Candidate("tokamax mosaic VJP", "tokamax", vjp_build, config=config)]

        def swiglu_build():
            tokamax, _ = h.import_tokamax()
            rd = functools.partial(tokamax.ragged_dot, implementation="mosaic")
            fn = lambda x, wg, wu, gs: jax.nn.silu(rd(x, wg, gs)) * rd(x, wu, gs)  # noqa: E731
            return h.jax_runner(fn, p.x, p.w_gate, p.w_up, p.gs)

        return [Candidate("tokamax 2x mosaic + silu*up", "tokamax", swiglu_build, extra=True,
                          config=config)]  # fmt: skip

    def jax_example_candidates(self, product: str) -> list[Candidate]:
        p, tiles = self.p, JAX_EXAMPLE_TILES
        config = " ".join(f"{key}={value}" for key, value in tiles.items())

        def build(module, fn_name, lhs, rhs, **kw):
            def b():
                if not self.on_gpu:
                    raise h.NotAvailable(
                        f"needs a CUDA GPU (JAX backend is {jax.default_backend()})"
                    )
                mod = importlib.import_module(f"jax.experimental.pallas.ops.gpu.{module}")
                fn = functools.partial(getattr(mod, fn_name), **tiles, **kw)
                return h.jax_runner(lambda a, c, g: fn(a, c, group_sizes=g), lhs, rhs, p.gs)

            return b

        name = "jax example mgpu"
        builds = {
            "forward": (name, build("ragged_dot_mgpu", "ragged_dot", p.x, p.w), False),
            "dgrad": (name, build("ragged_dot_mgpu", "ragged_dot", p.dout, p.w,
                                  transpose_rhs=True), True),
            "wgrad": (name + " (transposed_ragged_dot)", build(
                "transposed_ragged_dot_mgpu", "transposed_ragged_dot", p.x, p.dout), True),
        }  # fmt: skip
        if product not in builds:
            return []
        label, b, extra = builds[product]
        return [Candidate(label, "jax_example", b, extra=extra, config=config)]

    def xla_candidates(self, product: str) -> list[Candidate]:
        p = self.p
        if product not in self.args.xla_products or product == "swiglu":
            return []
        if product == "backward":

            def vjp_build():
                self._xla_dense_guard(product)
                return self._vjp_runner(lambda a, b: jax.lax.ragged_dot(a, b, p.gs))

            return [Candidate("xla ragged_dot VJP", "xla", vjp_build)]
        (lhs, rhs), dot_dims, rhs_group = {
            "forward": ((p.x, p.w), (([1], [1]), ([], [])), [0]),
            "dgrad": ((p.dout, p.w), (([1], [2]), ([], [])), [0]),
            "wgrad": ((p.x, p.dout), (([0], [0]), ([], [])), []),
        }[product]
        numbers = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=dot_dims, lhs_ragged_dimensions=[0],
            rhs_group_dimensions=rhs_group,
        )  # fmt: skip

        def build():
            if product == "wgrad":
                self._xla_dense_guard(product)
            fn = functools.partial(jax.lax.ragged_dot_general, ragged_dot_dimension_numbers=numbers)
            return h.jax_runner(lambda a, b, g: fn(a, b, g), lhs, rhs, p.gs)

        # dgrad and wgrad: the slowest and least telling (4-100 TFLOP/s), run as extras.
        extra = product in ("dgrad", "wgrad")
        return [Candidate("xla ragged_dot", "xla", build, extra=extra,
                          config="jax.lax.ragged_dot_general")]  # fmt: skip

    def _xla_dense_guard(self, product: str) -> None:
        """XLA:GPU lowers the ragged-contracting dot (the weight gradient) through dense
        per-group operands, bf16[G, M, K] and bf16[G, M, N] (its VJP adds a bf16[M, G, K]
        transpose), as the HLO of its out-of-memory failures on an H200 shows: refuse up front
        what cannot fit rather than spend compile and autotuning time."""
        need = xla_dense_bytes(self.p.shape, product)
        available = h.jax_memory_available()
        if available is not None and need > available:
            raise h.NotAvailable(
                f"XLA's {product} builds dense per-group operands of {need / 2**30:.0f} GiB "
                f"(G*M*(K+N{'+K' if product == 'backward' else ''}) bf16), "
                f"{available / 2**30:.0f} GiB free for JAX"
            )


# ---------------------------------------------------------------------------------------------
# Our kernels' configs from a sweep (bench/gmm_sweep.py)


def best_run(pair_record: dict) -> dict | None:
    """The fastest run of our kernel that passed its check and repeated bitwise: the highest
    paired x torch when every such run was paired with torch, else the lowest median."""
    passing = [
        r
        for r in pair_record["runs"]
        if r.get("ok") and r.get("bitwise_repeatable", {}).get("identical", False)
    ]
    if not passing:
        return None
    if all("x_torch_paired" in r for r in passing):
        return max(passing, key=lambda r: r["x_torch_paired"])
    return min(passing, key=lambda r: r["median_ms"])


def best_configs(sweep: dict) -> dict[tuple[str, str], dict]:
    """{(product, shape name): {"config": TileConfig, "label", "median_ms", "x_torch"}} from a
    sweep.json's contents: each pair's fastest passing, bitwise-repeatable config."""
    out = {}
    for record in sweep.get("pairs", []):
        best = best_run(record)
        if best is not None:
            out[(record["product"], record["shape"])] = {
                "config": TileConfig(**best["config"]),
                "label": best["label"],
                "median_ms": best["median_ms"],
                "x_torch": best.get("x_torch"),
            }
    return out


# ---------------------------------------------------------------------------------------------
# The run


def run_candidate(
    cand: Candidate, product: str, *, full, subsets, sizes, args, budget: h.Budget, paired_with=None
) -> tuple[dict, h.Runner | None, tuple]:
    """`h.measure` of one candidate, checked against `full` and `subsets`; timed paired with
    the torch runner `paired_with` if given ("x_torch_paired": the median of torch_i /
    ours_i)."""
    rec: dict[str, Any] = {"name": cand.name, "family": cand.family, "extra": cand.extra}
    if cand.config_source:
        rec["config_source"] = cand.config_source
    if cand.config:
        try:
            rec["config"] = cand.config() if callable(cand.config) else cand.config
        except Exception as e:  # e.g. the module does not import: the build reports it
            rec["config"] = f"could not describe it: {e!r}"[:300]
    skipped = budget.skip_reason(extra=cand.extra)
    if skipped is not None:
        rec["status"] = skipped
        return rec, None, ()
    measured, runner, outs = h.measure(
        cand.build,
        lambda outs: check(outs, full, subsets, sizes),
        names=PARTS[product],
        args=args,
        paired_with=paired_with,
    )
    rec.update(measured)
    if "paired" in rec:
        ratios = rec["paired"]["base_over_this"]
        rec["x_torch_paired"] = ratios["median"]
        rec["x_torch_paired_p25_p75"] = [ratios["p25"], ratios["p75"]]
    rec["t_end_s"] = round(budget.elapsed(), 1)
    return rec, runner, outs


def run_product(p: Problem, product: str, args, budget: h.Budget, save) -> dict:
    """Every candidate of one product, in FAMILIES order; `save()` after each."""
    flops, nbytes = product_cost(p.shape, product)
    entry: dict[str, Any] = {"flops": flops, "min_bytes_bf16_out": nbytes}
    skipped = budget.skip_reason()
    if skipped is not None:
        entry["skipped"] = skipped
        return entry
    t0 = time.perf_counter()
    try:
        subsets = subset_reference(p, product, cap=args.subset_rows)
    except Exception as e:  # recorded; the other products still run
        h.failed(entry, "error in reference.py parts", e)
        entry["skipped"] = entry.pop("status")
        return entry
    entry |= {"reference_s": round(time.perf_counter() - t0, 2), "candidates": []}
    entry["full_reference"] = "torch"
    full, torch_run = None, None
    for cand in Bench(args, p).candidates(product):
        if cand.family not in ("torch", "ours"):
            torch_run = None  # ours are done (FAMILIES order): XLA may need the memory
        if full is None and cand.family != "torch" and not budget.skip_reason(extra=cand.extra):
            full = full_reference(p, product)  # torch did not run or failed its check
            entry["full_reference"] = "xla ragged_dot / reference.tgmm in f32 (no torch)"
        paired = torch_run if cand.family == "ours" and args.paired else None
        rec, runner, outs = run_candidate(
            cand, product, full=full, subsets=subsets, sizes=p.sizes, args=args, budget=budget,
            paired_with=paired,
        )  # fmt: skip
        if cand.family == "torch" and rec.get("check", {}).get("ok"):
            full = outs  # torch's result: the all-elements reference of the others
            torch_run = runner if "timing" in rec else None
        del runner, outs
        if "timing" in rec:
            rec["tflops"] = flops / (rec["timing"]["median_ms"] * 1e-3) / 1e12
        entry["candidates"].append(rec)
        _ratios(entry)
        _print_rec(product, rec, entry["torch_median_ms"])
        save()
    return entry


def run_shape(shape: Shape, args, budget: h.Budget, torch, save: Callable[[dict], None]) -> dict:
    """All products of one shape; `save(partial result)` after every candidate."""
    t0 = time.perf_counter()
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
    print(f"== {shape.name} M={shape.m} K={shape.k} N={shape.n} G={shape.g}", flush=True)
    if skipped := budget.skip_reason():
        result["skipped"] = skipped
        return result
    try:
        p = make_problem(shape, torch)
    except Exception as e:  # recorded; the other shapes still run
        h.failed(result, "error making the inputs", e)
        result["skipped"] = result.pop("status")
        return result
    for product in args.products:
        if product != "swiglu" or shape.gate_up:
            result["products"][product] = {}
            entry = run_product(p, product, args, budget, lambda: save(result))
            result["products"][product] = entry
            if product == "backward":
                _derive_ours_backward(result["products"], entry)
            result["wall_s"] = round(time.perf_counter() - t0, 1)
            save(result)
    del p
    if torch is not None and jax.default_backend() == "gpu":
        torch.cuda.empty_cache()
    return result


def _ratios(entry: dict) -> None:
    torch_ms = next(
        (c["timing"]["median_ms"] for c in entry["candidates"] if c["family"] == "torch"
         and "timing" in c), None,
    )  # fmt: skip
    entry["torch_median_ms"] = torch_ms
    for c in entry["candidates"]:
        if torch_ms is not None and "timing" in c:
            c["x_torch"] = torch_ms / c["timing"]["median_ms"]


def _find(entry: dict | None, name: str) -> dict | None:
    return next((c for c in (entry or {}).get("candidates", []) if c["name"] == name), None)


def _derive_ours_backward(products: dict, entry: dict) -> None:
    """Our backward as the sum of the dgrad and wgrad (bf16 out) medians, beside the
    custom_vjp's own time."""
    dgrad, wgrad = (
        _find(products.get("dgrad"), MAIN["dgrad"]),
        _find(products.get("wgrad"), MAIN["wgrad"]),
    )
    if not (dgrad and wgrad and "timing" in dgrad and "timing" in wgrad):
        return
    ms = dgrad["timing"]["median_ms"] + wgrad["timing"]["median_ms"]
    bits = [c["bitwise_repeatable"] for c in (dgrad, wgrad)]
    rec = {
        "name": "ours dgrad + wgrad (sum of medians)", "family": "ours", "extra": False,
        "status": "derived", "timing": {"median_ms": ms},
        "tflops": entry["flops"] / (ms * 1e-3) / 1e12,
        "bitwise_repeatable": {"identical": all(b["identical"] for b in bits),
                               "runs": bits[0]["runs"]},
        "check": {"ok": dgrad["check"]["ok"] and wgrad["check"]["ok"]},
    }  # fmt: skip
    if entry.get("torch_median_ms"):
        rec["x_torch"] = entry["torch_median_ms"] / ms
    entry["candidates"].append(rec)


def _print_rec(product: str, rec: dict, torch_ms: float | None) -> None:
    when = f"t={rec.get('t_end_s', 0):.0f}s"
    if "timing" not in rec:
        print(f"  {product:8s} {rec['name']:40s} {rec['status'][:160]} [{when}]", flush=True)
        for part in rec.get("check", {}).get("parts", []):
            if not part["ok"]:
                print(f"    check: {json.dumps(part, default=str)[:900]}", flush=True)
        return
    t = rec["timing"]
    ratio = f" {torch_ms / t['median_ms']:.2f}x torch" if torch_ms else ""
    if "x_torch_paired" in rec:
        lo, hi = rec["x_torch_paired_p25_p75"]
        ratio += f" (paired {rec['x_torch_paired']:.3f}x, p25-p75 {lo:.3f}-{hi:.3f})"
    bits = "bitwise" if rec["bitwise_repeatable"]["identical"] else "NOT bitwise"
    print(
        f"  {product:8s} {rec['name']:40s} {t['median_ms']:9.3f} ms {rec.get('tflops', 0):7.1f} "
        f"TFLOP/s{ratio} [{bits}; compile {rec.get('compile_s', 0):.1f} s; {when}]",
        flush=True,
    )


def measure_ceilings(torch) -> dict:
    """Dense bf16 matmul 8192^3 (XLA and torch) and a device copy: the rates to hold us to."""
    n, out = 8192, {}
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    how = dict(warmup=2, timed=10, target_sample_s=0.005)
    ms = h.time_runner(h.jax_runner(jnp.matmul, a, b), **how)["median_ms"]
    out["xla_matmul_8192_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
    if torch is not None:
        ta, tb = torch.from_dlpack(a), torch.from_dlpack(b)
        ms = h.time_runner(h.torch_runner(torch, lambda: ta @ tb, on_gpu=True), **how)["median_ms"]
        out["torch_matmul_8192_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
        src = torch.empty(2**31, dtype=torch.uint8, device="cuda").random_(0, 255)
        dst = torch.empty_like(src)
        copy = h.torch_runner(torch, lambda: dst.copy_(src), on_gpu=True)
        ms = h.time_runner(copy, **how)["median_ms"]
        out["copy_tb_per_s_read_plus_write"] = 2 * src.numel() / (ms * 1e-3) / 1e12
        del src, dst, ta, tb
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------
# Markdown


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
    bits = f"; {_bits_cell(c)}" if _bits_cell(c) else ""
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


def _cell(c: dict | None) -> str:
    if c is None:
        return "-"
    if "tflops" in c:
        ratio = f" ({c['x_torch']:.2f}x)" if "x_torch" in c else ""
        fail = " **FAILED CHECK**" if not c.get("check", {}).get("ok", True) else ""
        return f"{c['tflops']:.1f}{ratio}{fail}"
    for short in ("failed check", "not available", "skipped", "error"):
        if c["status"].lower().startswith(short):
            return short
    return c["status"][:40]


def _target_cell(c: dict) -> str:
    if "x_torch_paired" not in c:
        return f"{c['x_torch']:.3f}x"
    lo, hi = c["x_torch_paired_p25_p75"]
    return f"{c['x_torch_paired']:.3f}x paired [{lo:.3f}-{hi:.3f}] (unpaired {c['x_torch']:.3f}x)"


def _paired_cell(c: dict) -> str:
    if "x_torch_paired" not in c:
        return "-"
    lo, hi = c["x_torch_paired_p25_p75"]
    torch_ms = c["paired"]["base_timing"]["median_ms"]
    return f"{c['x_torch_paired']:.3f} [{lo:.3f}-{hi:.3f}]; torch {torch_ms:.3f} ms"


def _targets(results: dict) -> list[str]:
    lines = [
        "## Targets (ours against torch, measured side by side)",
        "",
        "A cell: the paired ratio where there is one (our kernel timed in alternation with "
        "torch: the median of the per-pair ratios torch_i / ours_i, [25th-75th percentile]), "
        "judged against the target; then, as `unpaired`, torch's median over ours from their "
        "separate timings. A cell without `paired` is the unpaired ratio, judged.",
        "",
    ]
    header = [
        "shape", *(f"{p} x torch, paired" + (f" (>= {TARGETS[p]})" if TARGETS[p] else "")
                   for p in PRODUCTS), "bitwise (all ours)",
    ]  # fmt: skip
    rows = []
    for s in results["shapes"]:
        cells, bits = [], []
        for product in PRODUCTS:
            entry = s["products"].get(product)
            if entry is None or "candidates" not in entry:
                cells.append("-" if entry is None else "skipped")
                continue
            ours = [c for c in entry["candidates"] if c["family"] == "ours" and not c["extra"]]
            ours = [c for c in ours if c["name"] == MAIN[product]] or ours
            timed = [c for c in ours if "x_torch" in c]
            if timed:
                best = max(timed, key=lambda c: c.get("x_torch_paired", c["x_torch"]))
                ratio, want = best.get("x_torch_paired", best["x_torch"]), TARGETS[product]
                mark = "" if want is None else (" (met)" if ratio >= want else " (**missed**)")
                cells.append(_target_cell(best) + mark)
            elif any("timing" in c for c in ours):
                cells.append("no torch time")
            else:
                cells.append(ours[0]["status"].split(":")[0] if ours else "-")
            bits += [_bits_cell(c) for c in entry["candidates"]
                     if c["family"] == "ours" and "bitwise_repeatable" in c
                     and c["status"] != "derived"]  # fmt: skip
        if not bits:
            bit_cell = "-"
        elif all(b.endswith(": yes") for b in bits):
            bit_cell = bits[0].split(":")[0] + ": yes"
        else:
            bit_cell = "; ".join(b for b in bits if not b.endswith(": yes"))
        cells = ["skipped"] * len(PRODUCTS) if s.get("skipped") else cells
        rows.append([s["shape"]["name"], *cells, bit_cell])
    return lines + h.table(header, rows)


def _per_product(results: dict) -> list[str]:
    lines = [
        "## TFLOP/s (x torch) per product and shape",
        "",
        "TFLOP/s = 2*M*K*N (backward: twice that) over the median; in parentheses torch's "
        "median over the candidate's.",
    ]
    for product in PRODUCTS:
        entries = [s["products"][product] for s in results["shapes"] if product in s["products"]]
        order: dict[str, tuple[int, int]] = {}
        for entry in entries:
            for c in entry.get("candidates", []):
                order.setdefault(
                    c["name"], (int(c.get("extra", False)), FAMILIES.index(c["family"]))
                )
        names = sorted(order, key=lambda n: order[n])
        if not names:
            continue
        rows = []
        for s in results["shapes"]:
            entry = s["products"].get(product)
            if entry is not None:
                by_name = {c["name"]: c for c in entry.get("candidates", [])}
                row = [_cell(by_name.get(n)) for n in names]
                rows.append(
                    [s["shape"]["name"], *(["skipped"] * len(names) if "skipped" in entry else row)]
                )
        lines += ["", f"### {product}", "", *h.table(["shape", *names], rows)]
    return lines


def _design_deviation(results: dict) -> list[str]:
    """DESIGN.md's forward TFLOP/s against this run's; the same as milliseconds a call (a
    constant per-call difference shows there)."""
    rows = []
    for s in results["shapes"]:
        entry = s["products"].get("forward") or {}
        for c in entry.get("candidates", []):
            want = s["shape"]["design_tflops"].get(c["name"])
            if want is None:
                continue
            design_ms = entry["flops"] / (want * 1e12) * 1e3
            got, dev_cell, ms, diff = c["status"].split(":")[0], "-", "-", "-"
            if c.get("tflops") is not None:
                dev = (c["tflops"] - want) / want
                got, ms = f"{c['tflops']:.1f}", f"{c['timing']['median_ms']:.3f}"
                dev_cell = f"{dev:+.1%}" + (" **FLAG**" if abs(dev) > 0.10 else "")
                diff = f"{c['timing']['median_ms'] - design_ms:+.3f}"
            rows.append(
                [s["shape"]["name"], c["name"], want, got, dev_cell, f"{design_ms:.3f}", ms, diff]
            )
    header = ["shape", "candidate", "DESIGN.md TFLOP/s", "measured", "deviation",
              "DESIGN.md ms", "measured ms", "difference ms"]  # fmt: skip
    return ["## Baselines against DESIGN.md (forward; flagged: more than 10% off)", "",
            *h.table(header, rows)]  # fmt: skip


def render_markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        "# Grouped GEMM: our kernels against torch, tokamax, XLA",
        "",
        f"- command: `{env['command']}`; date (UTC): {env['date']}",
        f"- {h.versions_line(env)}",
        f"- method: {results['method']}",
        f"- our kernels' tile configs: {results.get('our_configs', {}).get('source')}",
    ]
    if isinstance(results.get("ceilings"), dict):
        lines.append("- ceilings measured in this run: " + ", ".join(
            f"{k} = {v:.1f}" if isinstance(v, float) else f"{k}: {v}"
            for k, v in results["ceilings"].items()))  # fmt: skip
    lines += ["", *_targets(results), "", *_per_product(results), "", *_design_deviation(results)]
    configs, skipped = [], []
    for s in results["shapes"]:
        name = s["shape"]["name"]
        if s.get("skipped"):
            skipped.append(f"- {name}: {s['skipped']}")
        for product, entry in s["products"].items():
            if entry.get("skipped"):
                skipped.append(f"- {name} {product}: {entry['skipped']}")
            for c in entry.get("candidates", []):
                if c["status"].startswith("skipped"):
                    skipped.append(f"- {name} {product} {c['name']}: {c['status']}")
                if c["family"] == "ours" and c.get("status") != "derived":
                    configs.append([name, product, c["name"], str(c.get("config", "-")),
                                    c.get("config_source", "-")])  # fmt: skip
    configs = [[str(x).replace("|", "/") for x in row] for row in configs]
    lines += ["", "## Tile configs of our kernels", "",
              *h.table(["shape", "product", "candidate", "config", "source"], configs)]  # fmt: skip
    if skipped:
        lines += ["", "## Skipped", "", *skipped]
    header = ["product", "candidate", "median ms", "min-max ms", "TFLOP/s", "x torch",
              "x torch paired", "status", "config"]  # fmt: skip
    for s in results["shapes"]:
        sh, gs = s["shape"], s["group_sizes"]
        rows = []
        for product, entry in s["products"].items():
            for c in entry.get("candidates", []):
                t = c.get("timing", {})
                config = str(c.get("config", "")).replace("|", "/")
                rows.append([
                    product, c["name"] + (" (extra)" if c.get("extra") else ""),
                    f"{t['median_ms']:.3f}" if t else "-",
                    f"{t['min_ms']:.3f}-{t['max_ms']:.3f}" if "min_ms" in t else "-",
                    f"{c['tflops']:.1f}" if "tflops" in c else "-",
                    f"{c['x_torch']:.2f}" if "x_torch" in c else "-", _paired_cell(c),
                    _status_cell(c),
                    "see 'Tile configs'" if c["family"] == "ours" and config else config[:160],
                ])  # fmt: skip
        lines += [
            "", f"## {sh['name']}: M={sh['m']}, K={sh['k']}, N={sh['n']}, G={sh['g']}", "",
            f"Routing: {s['routing']}; group sizes min {gs['min']}, median {gs['median']:.0f}, "
            f"max {gs['max']}, empty {gs['empty']}. Wall time {s.get('wall_s', '-')} s.",
            "", *h.table(header, rows),
        ]  # fmt: skip
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.add_run_args(ap)
    ap.add_argument("--products", default=",".join(PRODUCTS))
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument(
        "--subset-rows", type=int, default=256,
        help="rows at each end of a checked group for the reference.py check",
    )  # fmt: skip
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument(
        "--xla-products", default="forward,dgrad,wgrad,backward",
        help="products timed for XLA ragged_dot (dgrad and wgrad: extras)",
    )  # fmt: skip
    ap.add_argument(
        "--configs", type=pathlib.Path, default=None,
        help="a bench.gmm_sweep sweep.json: time our kernels with its best passing config per "
        "(product, shape) instead of the defaults table",
    )  # fmt: skip
    args = ap.parse_args(argv)
    h.check_run_args(ap, args, SMOKE_SHAPES if args.smoke else SHAPES)
    args.products = h.pick(ap, args.products, PRODUCTS, "product")
    args.families = h.pick(ap, args.families, FAMILIES, "family")
    args.xla_products = h.pick(ap, args.xla_products, PRODUCTS, "xla product")
    args.sweep_configs = {}
    if args.configs is not None:
        try:
            args.sweep_configs = best_configs(json.loads(args.configs.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--configs {args.configs}: cannot read a sweep's best configs: {e!r}")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch, args.torch_missing = h.import_torch()
    budget = h.Budget(args.budget_s)
    results: dict[str, Any] = {
        "environment": h.environment(NAME, argv),
        "method": (
            f"bf16 random data; checked first (vs torch, all elements; vs reference.py f32 on "
            f"the first/middle/last/largest groups; |err| <= 2^-6 (|ref| + rms ref)); "
            f"{args.repeats} runs compared bitwise, and the last timed run against the first; "
            f"{args.warmup} warm-up + 1 calibration call (a call over "
            f"{h.SLOW_CALL_S * 1e3:.0f} ms: no more), then the median of {args.timed} samples "
            f"of >= {args.sample_s * 1e3:.0f} ms (back-to-back calls between two syncs, host "
            f"clock); TFLOP/s = 2*M*K*N / median (backward: twice that); XLA ragged_dot timed "
            f"for {','.join(args.xla_products)}"
            + (
                "; our kernels also timed paired with torch (x torch paired)"
                if args.paired
                else "; no paired timing"
            )
            + ("; SMOKE RUN: no number here means anything" if args.smoke else "")
        ),
        "args": {k: v for k, v in vars(args).items() if k not in ("shape_list", "sweep_configs")},
        "our_configs": {
            "source": f"sweep {args.configs}" if args.configs else "defaults table",
            "from_sweep": {
                f"{p} {s}": {"label": b["label"], "config": repr(b["config"])}
                for (p, s), b in args.sweep_configs.items()
            },
        },
        "shapes": [],
    }
    print(json.dumps(results["environment"], indent=1), flush=True)

    def save(index: int, shape_result: dict) -> None:
        results["shapes"][index : index + 1] = [shape_result]  # its own place (appended if new)
        results["elapsed_s"] = round(budget.elapsed(), 1)
        h.save(args.out, NAME, results, render_markdown(results))

    if jax.default_backend() == "gpu" and not args.no_ceilings:
        try:
            results["ceilings"] = measure_ceilings(torch)
        except Exception as e:
            results["ceilings"] = {"error": repr(e)}
        print("ceilings:", results["ceilings"], flush=True)
    for index, shape in enumerate(args.shape_list):
        save(index, run_shape(shape, args, budget, torch, functools.partial(save, index)))
    print(f"wrote {args.out}/{NAME}.{{json,md}} after {budget.elapsed():.0f} s")
    return results


if __name__ == "__main__":
    main()
