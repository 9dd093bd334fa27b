"""Every Mosaic GPU kernel under the three contracts: one table of kernel cases, three tests.

  lowers for CUDA     at a real size, on this CPU machine, the kernel lowers to a Mosaic GPU
                      custom call (and whatever the row checks of its launch)
  interpret mode      at small sizes and tiles, in GPU interpret mode on the CPU, the kernel's
                      result is the reference's: its bits where the kernel promises bits, else
                      its values within the tolerance table's bound (pallas_kernels/tolerances)
  GPU twin            at a real size on a GPU (marked gpu; skipped without one): the same check
                      of the result, and the same bits on three runs

A row (`ArrayCase`, `ExchangeCase`, `RouterCase`) holds the kernel, the inputs it draws for a
problem, its reference and, per contract, the problems it runs: the grouped GEMMs (grouped_matmul/
mosaic_gpu.py, gathered rows included), the weight gradient (mosaic_gpu_wgrad.py), the
differentiable ops that chain them (ops.py, values and gradients), the router's forward and
its gradients (routing/), and the exchange's kernels
(exchange/mosaic_gpu.py; they signal their peers through semaphores, which interpret mode does
not run, so they have no interpret problems: their copies are tested in interpret mode beside
them). What is particular to a kernel (races, invariants, schedules, bad inputs) is tested beside
it, in the kernel's own test file. Problems not marked `fast` are marked slow (`./test.sh --all`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.exchange import protocol as xp
from pallas_kernels.grouped_matmul import mosaic_gpu, ops, reference
from pallas_kernels.grouped_matmul.mosaic_gpu_wgrad import tgmm
from pallas_kernels.grouped_matmul.tuning import TileConfig
from pallas_kernels.routing import mosaic_gpu as router
from pallas_kernels.routing import ops as router_ops
from pallas_kernels.routing import reference as router_reference
from pallas_kernels.routing.reference import RouterSpec
from pallas_kernels.tolerances import Tolerance, tolerance
from tests.pallas_kernels.exchange import test_mosaic_gpu as exchange
from tests.pallas_kernels.grouped_matmul import test_mosaic_gpu as grouped
from tests.pallas_kernels.grouped_matmul import test_mosaic_gpu_gather as gathered
from tests.pallas_kernels.grouped_matmul import test_mosaic_gpu_wgrad as wgrad
from tests.pallas_kernels.grouped_matmul import test_ops as grouped_ops
from tests.pallas_kernels.routing import test_mosaic_gpu as router_tests

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32

# ---------------------------------------------------------------------------------------------
# What a result must be.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Expect:
    """One output's contract: `bits` (the same bits, dtype and shape), and/or within the
    tolerance of `values` (f32) for an output of `dtype` computed in `compute` (the tolerance
    table's bound, or a scoped `tolerance`); rows from `zeros_from` on are zeros."""

    bits: Any = None
    values: Any = None
    dtype: Any = None
    compute: Any = F32
    tolerance: Tolerance | None = None
    zeros_from: int | None = None

    def check(self, out) -> None:
        if self.bits is not None:
            chex.assert_trees_all_equal(out, self.bits, strict=True)
        if self.values is not None:
            chex.assert_type(out, self.dtype)
            chex.assert_shape(out, self.values.shape)
            tol = self.tolerance or tolerance(self.compute, self.dtype)
            expected = jnp.asarray(self.values, F32)
            chex.assert_trees_all_close(
                jnp.asarray(out, F32), expected, rtol=tol.rtol, atol=tol.scaled_atol(expected)
            )
        if self.zeros_from is not None:
            past = out[self.zeros_from :]
            chex.assert_trees_all_equal(past, jnp.zeros_like(past))


def bits(value) -> Expect:
    return Expect(bits=value)


def close(values, dtype, *, compute=F32, tolerance: Tolerance | None = None) -> Expect:
    return Expect(values=values, dtype=jnp.dtype(dtype), compute=compute, tolerance=tolerance)


def _is_expectation(x) -> bool:
    return x is None or isinstance(x, Expect)


def assert_meets(outputs, expected) -> None:
    """Each output meets its `Expect` (expected: the outputs' tree, an Expect or None per
    output: None for an output the kernel returns as None)."""
    expects, tree = jax.tree.flatten(expected, is_leaf=_is_expectation)
    for out, expect in zip(tree.flatten_up_to(outputs), expects, strict=True):
        if expect is None:
            assert out is None, out
        else:
            expect.check(out)


# ---------------------------------------------------------------------------------------------
# Rows of grouped GEMMs: arrays in, arrays out, on one device.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    """The sizes of one grouped-GEMM call: lhs [M, K] (gathered from T rows when `t` is set),
    N output columns (F for SwiGLU), the group sizes; the inputs' dtype, the output's (None:
    the kernel's default), other keyword arguments of the call (`options`), the tiles (None:
    the kernel's default), the inputs' seed. `fast` keeps it in the fast tier."""

    m: int
    k: int
    n: int
    sizes: tuple[int, ...]
    t: int | None = None
    dtype: Any = BF16
    out_dtype: Any = None
    options: tuple[tuple[str, Any], ...] = ()
    config: TileConfig | None = None
    seed: int = 0
    fast: bool = False
    tag: str = ""

    def __str__(self) -> str:
        rows = f"{self.m}x{self.k}x{self.n}" + (f"_of_{self.t}" if self.t is not None else "")
        sizes = f"g{len(self.sizes)}" if len(self.sizes) > 7 else ",".join(map(str, self.sizes))
        parts = [rows, f"[{sizes}]"]
        if jnp.dtype(self.dtype) != jnp.dtype(BF16):
            parts.append(jnp.dtype(self.dtype).name)
        if self.out_dtype is not None:
            parts.append(f"to_{jnp.dtype(self.out_dtype).name}")
        parts += [f"{name}={value}" for name, value in self.options]
        return "-".join(parts + ([self.tag] if self.tag else []))


def _problems(cases, **fields) -> tuple[Problem, ...]:
    """Problems of (M, K, N, sizes) tuples, each with `fields`."""
    return tuple(Problem(m=m, k=k, n=n, sizes=tuple(s), **fields) for m, k, n, s in cases)


def _fast_first(problems: tuple[Problem, ...]) -> tuple[Problem, ...]:
    """The problems, the first of them in the fast tier."""
    return (dataclasses.replace(problems[0], fast=True), *problems[1:])


def _all_fast(*problems: Problem) -> tuple[Problem, ...]:
    return tuple(dataclasses.replace(p, fast=True) for p in problems)


def uniform_sizes(num_rows: int, num_groups: int, seed: int, align: int = 1) -> tuple[int, ...]:
    """`num_rows` rows over `num_groups` groups uniformly at random (each size rounded down to a
    multiple of `align`)."""
    ids = np.random.default_rng(seed).integers(0, num_groups, num_rows)
    return tuple(int(s) // align * align for s in np.bincount(ids, minlength=num_groups))


def _draw(p: Problem, name: str):
    """The input `name` of problem p, drawn from its own key."""
    key = jax.random.fold_in(jax.random.key(p.seed), _ARRAYS.index(name))
    m, k, n, g = p.m, p.k, p.n, len(p.sizes)

    def normal(shape, scale=1.0, dtype=p.dtype):
        return (jax.random.normal(key, shape, F32) * scale).astype(dtype)

    match name:
        case "lhs" | "dy":  # [M, K]: the rows, and the down projection's cotangent
            return normal((m, k))
        case "x":  # [T, K]: the rows that gathered rows read
            return normal((p.t, k))
        case "rows":  # [M]: the lhs row of each gathered row
            return jax.random.randint(key, (m,), 0, p.t, jnp.int32)
        case "rhs" | "w_up":  # [G, K, N]
            return normal((g, k, n), 0.25)
        case "rhs_t" | "w_down":  # [G, N, K]
            return normal((g, n, k), 0.25)
        case "rhs_t_parts":  # [G, N, K / 2] twice: the transposed rhs in two parts along K
            return tuple(
                (jax.random.normal(part, (g, n, k // 2), F32) * 0.25).astype(p.dtype)
                for part in jax.random.split(key)
            )
        case "rhs_mn":  # [M, N]: tgmm's second operand
            return normal((m, n))
        case "scale":  # [M] f32: the routing weights
            return jax.random.uniform(key, (m,), F32, 0.5, 1.5)
        case "ct_n" | "ct_k":  # f32 cotangents of an [M, N] and an [M, K] output
            return normal((m, n) if name == "ct_n" else (m, k), dtype=F32)
        case "sizes":
            return jnp.asarray(p.sizes, jnp.int32)
    raise ValueError(f"no input {name!r}")


_ARRAYS = ("lhs", "dy", "x", "rows", "rhs", "w_up", "rhs_t", "w_down", "rhs_t_parts", "rhs_mn",
           "scale", "ct_n", "ct_k", "sizes")  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArrayCase:
    """A kernel of arrays: kernel(*inputs, p=problem, run=...) and expect(*inputs, p=problem,
    run=...) (the `Expect` tree of its outputs), the inputs drawn by name (`_draw`); `run`
    holds the call's config and interpret arguments (the problem's tiles; interpret mode or
    not), which a reference made of other kernels runs them with. `zeros_past_groups`: rows
    past every group are zeros in every output. `target_h200`: lowered for an abstract H200
    mesh (the device the kernel reads its tiles for)."""

    name: str
    arrays: tuple[str, ...]
    kernel: Callable[..., Any]
    expect: Callable[..., Any]
    interpret: tuple[Problem, ...] = ()
    lowered: tuple[Problem, ...] = ()
    gpu: tuple[Problem, ...] = ()
    zeros_past_groups: bool = True
    target_h200: bool = False

    def inputs(self, p: Problem) -> tuple:
        return tuple(_draw(p, name) for name in self.arrays)

    def lower(self, p: Problem) -> jax.stages.Lowered:
        args = jax.eval_shape(lambda: self.inputs(p))
        call = functools.partial(self.kernel, p=p, run=dict(config=p.config, interpret=False))
        target = jax.sharding.use_abstract_mesh(wgrad.H200) if self.target_h200 else None
        with target or contextlib.nullcontext():
            return jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))

    def check_lowered(self, text: str, p: Problem) -> None:
        del text, p  # the Mosaic GPU call is all a grouped GEMM's lowering promises

    def runner(self, p: Problem, *, interpret: bool) -> tuple[Callable, Callable]:
        """(run, expected): the kernel on p's inputs (jitted, unless in interpret mode, which
        runs it as it is called), and the `Expect` tree of its result."""
        inputs = self.inputs(p)
        run_args = dict(config=p.config, interpret=interpret)
        call = functools.partial(self.kernel, p=p, run=run_args)
        call = call if interpret else jax.jit(call)

        def expected():
            tree = self.expect(*inputs, p=p, run=run_args)
            if not self.zeros_past_groups:
                return tree
            past = min(sum(p.sizes), p.m)
            return jax.tree.map(
                lambda e: e and dataclasses.replace(e, zeros_from=past),
                tree,
                is_leaf=_is_expectation,
            )

        return (lambda: call(*inputs)), expected


# The grouped GEMMs' small problems (grouped_matmul/test_mosaic_gpu.py's CASES): A (200, 128,
# 128) with an empty group, B (37, 64, 128) one group of every row, C (1, 64, 128) one row,
# D (131, 128, 256) partial tiles, E (50, 64, 128) groups past M (clamped). GPU interpret mode's
# tiles: the interpret table's (3 programs, several tiles each).
A, B, C, D, E = grouped.CASES
SMALL = grouped.SMALL
# Real sizes: qwen3-30b-a3b's gate_up (M = 16384 tokens x top-8, K = D = 2048, N = 2 F = 1536,
# 128 experts) for the lowering; the GPU twins at 16384 rows (16381: M not a multiple of 8),
# rows past every group at the end.
M, K, N, G = 131072, 2048, 1536, 128
CLUSTERS = {name: dataclasses.replace(mosaic_gpu.default_config(n=N), consumer_dim="m", **c)
            for name, c in grouped.CLUSTERS.items()}  # fmt: skip


def _real(m, k, n, *, rows_in_groups=None, groups=G, seed=0, **fields) -> Problem:
    """A real-size problem: `rows_in_groups` (default all M) rows over `groups` uniformly."""
    sizes = uniform_sizes(m if rows_in_groups is None else rows_in_groups, groups, seed)
    return Problem(m=m, k=k, n=n, sizes=sizes, **fields)


def _lowered(m, k, n, groups=G, **fields) -> Problem:
    """A problem to lower: the group sizes are abstract there."""
    return Problem(m=m, k=k, n=n, sizes=(0,) * groups, **fields)


def _gmm(lhs, rhs, sizes, *, p, run, **kwargs):
    return mosaic_gpu.gmm(lhs, rhs, sizes, out_dtype=p.out_dtype, **kwargs, **run)


def _gmm_swiglu_bwd_expect(lhs, dy, w_gate, w_up, w_down, sizes, scale=None, *, p, run):
    """h the bits of gmm_swiglu; [d_gate | d_up] and d_s the unfused formulas' values
    (grouped_matmul/test_mosaic_gpu.py's swiglu_bwd_parts) to their rounding."""
    del p
    h, d_gate_up, d_s = grouped.swiglu_bwd_parts(lhs, dy, w_gate, w_up, w_down, sizes, scale, run)
    return bits(h), close(d_gate_up, lhs.dtype), None if scale is None else close(d_s, F32)


GROUPED_GEMMS = [
    ArrayCase(
        name="gmm",
        arrays=("lhs", "rhs", "sizes"),
        kernel=_gmm,
        expect=lambda lhs, rhs, sizes, *, p, run: close(
            reference.gmm(lhs, rhs, sizes), p.out_dtype or lhs.dtype
        ),
        interpret=_fast_first(
            _problems([B, A, C, D, E], config=SMALL)
            + _problems([A, B, C, D, E], out_dtype=F32, config=SMALL)
        ),
        lowered=(
            _lowered(M, K, N, fast=True),
            _lowered(M - 3, K, N, tag="rows_not_a_multiple_of_8"),
            _lowered(M, K, N, out_dtype=F32),
            *(_lowered(M, K, N, config=c, tag=name) for name, c in CLUSTERS.items()),
        ),
        gpu=(
            _real(16384, K, N, rows_in_groups=16284, out_dtype=F32),
            _real(16384, K, N, rows_in_groups=16284),
        ),
    ),
    ArrayCase(
        name="gmm_dgrad",  # transpose_rhs: rhs [G, N, K], the input gradient of gmm
        arrays=("lhs", "rhs_t", "sizes"),
        kernel=functools.partial(_gmm, transpose_rhs=True),
        expect=lambda lhs, rhs_t, sizes, *, p, run: close(
            reference.gmm(lhs, rhs_t, sizes, transpose_rhs=True), p.out_dtype or lhs.dtype
        ),
        interpret=_fast_first(_problems([B, A, D], out_dtype=F32, config=SMALL)),
        lowered=(_lowered(M, N, K),),
        gpu=(_real(16384, K, N, rows_in_groups=16284, out_dtype=F32),),
    ),
    ArrayCase(
        name="gmm_dgrad_rhs_k_parts",  # [d_gate | d_up] @ [w_gate | w_up].T, rhs in 2 parts
        arrays=("lhs", "rhs_t_parts", "sizes"),
        kernel=functools.partial(_gmm, transpose_rhs=True),
        expect=lambda lhs, parts, sizes, *, p, run: close(
            reference.gmm(lhs, jnp.concatenate(parts, axis=2), sizes, transpose_rhs=True),
            lhs.dtype,
        ),
        interpret=_problems([D], config=SMALL),
        lowered=(_lowered(M, 2 * N, K),),
        gpu=(_real(16384, N, K, rows_in_groups=16284),),
    ),
    ArrayCase(
        name="gmm_row_scaled",  # each row times its routing weight, in f32
        arrays=("lhs", "rhs", "sizes", "scale"),
        kernel=lambda lhs, rhs, sizes, scale, *, p, run: _gmm(
            lhs, rhs, sizes, p=p, run=run, row_scale_m=scale
        ),
        expect=lambda lhs, rhs, sizes, scale, *, p, run: close(
            reference.gmm(lhs, rhs, sizes) * scale[:, None], p.out_dtype or lhs.dtype
        ),
        interpret=_fast_first(
            _problems([A, D], out_dtype=F32, config=SMALL) + _problems([A, D], config=SMALL)
        ),
        lowered=(_lowered(M, K, N, out_dtype=F32),),
        gpu=(_real(16384, K, 768, out_dtype=F32, seed=1),),
    ),
    ArrayCase(
        name="gmm_swiglu",
        arrays=("lhs", "rhs", "w_up", "sizes"),
        kernel=lambda lhs, w_gate, w_up, sizes, *, p, run: mosaic_gpu.gmm_swiglu(
            lhs, w_gate, w_up, sizes, **run
        ),
        expect=lambda lhs, w_gate, w_up, sizes, *, p, run: close(
            reference.gmm_swiglu(lhs, w_gate, w_up, sizes), lhs.dtype
        ),
        interpret=_fast_first(
            _problems([B, A, D, E], config=SMALL) + _problems([A, B, D, E], dtype=F16, config=SMALL)
        ),
        lowered=(_lowered(M, K, N, fast=True),),
        gpu=(_real(16384, K, 768, seed=1),),
    ),
    ArrayCase(
        name="gmm_swiglu_gate_up_out",  # h, and gate and up each the bits of gmm's product
        arrays=("lhs", "rhs", "w_up", "sizes"),
        kernel=lambda lhs, w_gate, w_up, sizes, *, p, run: mosaic_gpu.gmm_swiglu(
            lhs, w_gate, w_up, sizes, gate_up_out=True, **run
        ),
        expect=lambda lhs, w_gate, w_up, sizes, *, p, run: (
            bits(mosaic_gpu.gmm_swiglu(lhs, w_gate, w_up, sizes, **run)),
            bits(mosaic_gpu.gmm(lhs, w_gate, sizes, **run)),
            bits(mosaic_gpu.gmm(lhs, w_up, sizes, **run)),
        ),
        interpret=_problems([A, D], config=SMALL),
        lowered=(_lowered(M, K, N),),
        gpu=(_real(16381, K, 768, rows_in_groups=16341, seed=1),),
    ),
    ArrayCase(
        name="gmm_swiglu_bwd",  # h, [d_gate | d_up] and (weighted) d_s in one kernel
        arrays=("lhs", "dy", "rhs", "w_up", "w_down", "sizes"),
        kernel=lambda lhs, dy, w_gate, w_up, w_down, sizes, *, p, run: mosaic_gpu.gmm_swiglu_bwd(
            lhs, dy, w_gate, w_up, w_down, sizes, **run
        ),
        expect=_gmm_swiglu_bwd_expect,
        interpret=_problems([B, A, D], config=SMALL),
        lowered=(_lowered(M, K, N // 2, fast=True),),
        gpu=(_real(16381, K, 768, rows_in_groups=16341, seed=1),),
    ),
    ArrayCase(
        name="gmm_swiglu_bwd_weighted",
        arrays=("lhs", "dy", "rhs", "w_up", "w_down", "sizes", "scale"),
        kernel=lambda lhs, dy, w_gate, w_up, w_down, sizes, scale, *, p, run: (
            mosaic_gpu.gmm_swiglu_bwd(
                lhs, dy, w_gate, w_up, w_down, sizes, row_scale_m=scale, **run
            )
        ),
        expect=_gmm_swiglu_bwd_expect,
        interpret=_fast_first(_problems([B, A, D], config=SMALL)),
        lowered=(_lowered(M, K, N // 2),),
        gpu=(_real(16381, K, 768, rows_in_groups=16341, seed=1),),
    ),
]

# ---------------------------------------------------------------------------------------------
# Gathered rows: row m of the product reads lhs row rows[m] of x [T, K]; the bits of the same
# call on the materialized x[rows], and the reference's values.

# (T, M, K, N, sizes) of grouped_matmul/test_mosaic_gpu_gather.py: more rows than tokens and
# fewer, M not a multiple of 8, empty groups, rows past every group.
GA, GB = (
    Problem(m=m, k=k, n=n, sizes=tuple(s), t=t, config=SMALL) for t, m, k, n, s in gathered.CASES
)
# Real size: qwen3-30b-a3b's 16384 tokens, top-8, D 2048, F 768, 128 experts, 40 rows past
# every group.
T_REAL, TOP_K = 16384, 8


def _gathered_real(k, n) -> Problem:
    m = T_REAL * TOP_K
    return Problem(m=m, k=k, n=n, sizes=uniform_sizes(m - 40, G, 0), t=T_REAL)


def _gathered_case(name, arrays, plain, spec, **fields) -> ArrayCase:
    """A gathered-rows row: inputs x, the operands, then the rows; `plain(lhs, *operands, p=,
    run=, **kwargs)` the call on materialized rows, `spec(lhs, *operands)` its reference."""

    def kernel(x, *rest, p, run):
        *operands, rows = rest
        return plain(x, *operands, p=p, run=run, lhs_rows_m=rows)

    def expect(x, *rest, p, run):
        *operands, rows = rest
        lhs = x[rows]
        return Expect(
            bits=plain(lhs, *operands, p=p, run=run),
            values=spec(lhs, *operands),
            dtype=jnp.dtype(p.out_dtype or x.dtype),
        )

    return ArrayCase(name=name, arrays=arrays, kernel=kernel, expect=expect, **fields)


GATHERED_ROWS = [
    _gathered_case(
        "gmm_gathered_rows",
        ("x", "rhs", "sizes", "rows"),
        _gmm,
        reference.gmm,
        interpret=(GB, GA),
        lowered=(_gathered_real(K, 768),),
        gpu=(_gathered_real(K, 768),),
    ),
    _gathered_case(
        "gmm_gathered_rows_row_scaled",
        ("x", "rhs", "sizes", "scale", "rows"),
        lambda x, rhs, sizes, scale, *, p, run, **kw: _gmm(
            x, rhs, sizes, p=p, run=run, row_scale_m=scale, **kw
        ),
        lambda x, rhs, sizes, scale: reference.gmm(x, rhs, sizes) * scale[:, None],
        interpret=tuple(dataclasses.replace(q, out_dtype=F32) for q in (GB, GA)),
        lowered=(dataclasses.replace(_gathered_real(768, K), out_dtype=F32),),
        gpu=(dataclasses.replace(_gathered_real(768, K), out_dtype=F32),),
    ),
    _gathered_case(
        "gmm_swiglu_gathered_rows",
        ("x", "rhs", "w_up", "sizes", "rows"),
        lambda x, w_gate, w_up, sizes, *, p, run, **kw: mosaic_gpu.gmm_swiglu(
            x, w_gate, w_up, sizes, **kw, **run
        ),
        reference.gmm_swiglu,
        interpret=(dataclasses.replace(GB, fast=True), GA),
        lowered=(dataclasses.replace(_gathered_real(K, 768), fast=True),),
        gpu=(_gathered_real(K, 768),),
    ),
    _gathered_case(
        "gmm_dgrad_gathered_rows",  # dgrad's layout, rhs [G, N, K]; T = 1: every row is row 0
        ("x", "rhs_t", "sizes", "rows"),
        functools.partial(_gmm, transpose_rhs=True),
        functools.partial(reference.gmm, transpose_rhs=True),
        interpret=tuple(
            Problem(m=37, k=128, n=256, sizes=(37,), t=t, config=SMALL) for t in (1, 300)
        ),
        lowered=(_gathered_real(768, K),),
        gpu=(_gathered_real(768, K),),
    ),
]

# ---------------------------------------------------------------------------------------------
# The weight gradient: out[g] = lhs[rows of g].T @ rhs[rows of g], [G, K, N].

# f32 sums of exact bf16 products over at most a few thousand rows: tighter than the tolerance
# table's f32 bound (its bf16 and f16 bounds are one rounding of the output).
TGMM_TOLERANCE = {
    jnp.dtype(dtype): Tolerance(rtol=bound, atol=bound) for dtype, bound in wgrad.TOLERANCE.items()
}


def _tgmm_problem(m, k, n, sizes, config, **fields) -> Problem:
    """grouped_matmul/test_mosaic_gpu_wgrad.py's seeds: the row count, unless given."""
    fields.setdefault("seed", m)
    fields.setdefault("tag", {ONE: "one_consumer", DELAYED: "delayed"}.get(config, ""))
    return Problem(m=m, k=k, n=n, sizes=tuple(sizes), config=config, **fields)


def _emptied(sizes: tuple[int, ...], group: int) -> tuple[int, ...]:
    """sizes with group `group` empty."""
    return (*sizes[:group], 0, *sizes[group + 1 :])


# tgmm's tiles: its tests' (grouped_matmul/test_mosaic_gpu_wgrad.py), and those its lowering
# runs besides the defaults: 128 x 256 tiles released without delay; a band 3 K tiles wide
# (not a power of 2: planar_snake's branchless path); clusters of two K tiles.
ONE, TWO, DELAYED = wgrad.SMALL_ONE_CONSUMER, wgrad.SMALL, wgrad.SMALL_DELAYED
TGMM_128X256 = TileConfig(block_m=128, block_n=256, max_concurrent_steps=3, delay_release=0)
TGMM_WIDTH_3 = TileConfig(
    block_n=256, max_concurrent_steps=3, delay_release=1, grid_minor_dim="m", grid_tile_width=3
)
TGMM_CLUSTER = TileConfig(block_n=256, max_concurrent_steps=3, cluster_m=2)
WEIGHT_GRADIENT = [
    ArrayCase(
        name="tgmm",
        arrays=("lhs", "rhs_mn", "sizes"),
        kernel=lambda lhs, rhs, sizes, *, p, run: tgmm(
            lhs, rhs, sizes, out_dtype=p.out_dtype or F32, **dict(p.options), **run
        ),
        expect=lambda lhs, rhs, sizes, *, p, run: close(
            reference.tgmm(lhs, rhs, sizes),
            p.out_dtype or F32,
            tolerance=TGMM_TOLERANCE[jnp.dtype(p.out_dtype or F32)],
        ),
        zeros_past_groups=False,
        target_h200=True,
        interpret=(
            _tgmm_problem(37, 128, 64, [37], ONE, fast=True),  # one group owns every row
            _tgmm_problem(1, 64, 128, [1], TWO),  # M smaller than a row block
            _tgmm_problem(37, 64, 128, [10, 0, 20], TWO),  # an empty group, sum < M, M odd
            _tgmm_problem(200, 128, 128, [60, 70, 0, 5, 65], TWO),  # partial blocks, sum = M
            _tgmm_problem(200, 64, 64, [64, 8, 80, 40, 0], ONE),  # starts on multiples of 8
            _tgmm_problem(200, 128, 128, [0, 0, 0], TWO, fast=True),  # no rows: zeros written
            _tgmm_problem(200, 64, 128, [150, 100, 30], TWO, fast=True),  # sum > M: clipped
            _tgmm_problem(200, 128, 64, [3, 190], TWO),  # N narrower than block_n
            # Unaligned starts: neighbours' rows are zeroed in the first and last blocks.
            _tgmm_problem(203, 128, 128, [17, 45, 0, 3, 70, 31, 37], TWO),
            _tgmm_problem(90, 64, 128, [3, 2, 6, 0, 79], ONE),  # rows 3..4 in one 8-row tile
            _tgmm_problem(101, 64, 128, [61, 4, 36], TWO),  # M % 8 = 5, the last group ends at M
            _tgmm_problem(150, 64, 128, [7, 64, 64, 15], TWO),  # first block one 8-row tile
            _tgmm_problem(203, 128, 128, [17, 45, 0, 3, 70, 31, 37], DELAYED),
            _tgmm_problem(300, 64, 128, [3, 250, 0, 47], DELAYED),  # 5 blocks a unit: wraps
            # f16 inputs, narrow outputs.
            *(
                _tgmm_problem(
                    120, 64, 128, [50, 0, 66], TWO, dtype=F16, out_dtype=out, seed=3, fast=True
                )
                for out in (BF16, F16)
            ),
        ),
        lowered=_all_fast(  # each under a second
            _lowered(M, K, N),
            _lowered(M, K, N, config=TGMM_128X256, tag="block_128x256_no_delay"),
            _lowered(16384, 4096, 28672, 8, config=TGMM_WIDTH_3, tag="grid_tile_width_3"),
            _lowered(37, 64, 128, 3, config=TWO),  # M padded
            _lowered(M, K, N, options=(("out_parts", 2),)),  # [d_w_gate | d_w_up] as 2 arrays
            _lowered(16384, 4096, 28672, 8, config=TGMM_CLUSTER, tag="cluster_m"),
        ),
        gpu=(
            *(
                Problem(m=16384, k=512, n=768, sizes=sizes, seed=9, tag=f"align_{align}")
                for align in (1, 8)
                for sizes in [_emptied(uniform_sizes(16284, 16, align, align), 3)]
            ),
            _real(M, K, N, seed=3),
        ),
    ),
]

# ---------------------------------------------------------------------------------------------
# The differentiable ops: values and every gradient (one random cotangent) against jax.vjp of
# the reference.

OPS_CASES = tuple(Problem(m=m, k=k, n=n, sizes=tuple(s)) for m, k, n, s in grouped_ops.CASES)
OPS_REAL = Problem(m=8192, k=K, n=768, sizes=uniform_sizes(8142, 32, 0))


def _vjp(op, diff, cotangent):
    """op's output and the gradients of `diff` for `cotangent` (in the output's dtype)."""
    out, vjp = jax.vjp(op, *diff)
    return out, vjp(cotangent.astype(out.dtype))


def _vjp_expect(spec, diff, cotangent, out_dtype, *, compute=F32, out_bits=None):
    """spec's output (rounded to `out_dtype`) and gradients, each to the rounding of its dtype,
    or of `compute` where a rounded intermediate feeds it; `out_bits`: the output's bits."""
    out, vjp = jax.vjp(spec, *diff)
    expected = close(out.astype(out_dtype), out_dtype, compute=compute)
    # The cotangent the kernel's output gets: rounded to its dtype.
    grads = vjp(cotangent.astype(out_dtype).astype(out.dtype))
    grads = jax.tree.map(lambda g: close(g, g.dtype, compute=compute), grads)
    return dataclasses.replace(expected, bits=out_bits), grads


def _mlp_spec(x, w_gate, w_up, w_down, sizes, scale=None):
    """The reference expert MLP, h rounded to bf16 as the kernels store it."""
    h = reference.gmm_swiglu(x, w_gate, w_up, sizes).astype(BF16)
    y = reference.gmm(h, w_down, sizes)
    return y if scale is None else y * scale[:, None]


def _swiglu_mlp(x, w_gate, w_up, w_down, sizes, ct, *scale, p, run):
    def op(*diff):
        return ops.swiglu_mlp(
            *diff[:4], sizes, row_scale_m=diff[4] if scale else None,
            interpret=run["interpret"], **dict(p.options),
        )  # fmt: skip

    return _vjp(op, (x, w_gate, w_up, w_down, *scale), ct)


def _swiglu_mlp_expect(x, w_gate, w_up, w_down, sizes, ct, *scale, p, run):
    """h is rounded to bf16 on both sides; one-ulp flips of it reach every later value. The
    forward is the two kernels' output, bit for bit."""
    h = ops.gmm_swiglu(x, w_gate, w_up, sizes, interpret=run["interpret"])
    chained = ops.gmm(
        h, w_down, sizes, row_scale_m=scale[0] if scale else None,
        out_dtype=None if scale else F32, interpret=run["interpret"],
    )  # fmt: skip
    spec = lambda *diff: _mlp_spec(*diff[:4], sizes, *diff[4:])  # noqa: E731
    return _vjp_expect(spec, (x, w_gate, w_up, w_down, *scale), ct, F32, compute=BF16,
                       out_bits=chained)  # fmt: skip


def _swiglu_then_gmm(x, w_gate, w_up, w_down, sizes, ct, scale, *, p, run):
    """The two ops chained as a layer chains them: gmm_swiglu, then the weighted gmm."""

    def op(x, w_gate, w_up, w_down, scale):
        h = ops.gmm_swiglu(x, w_gate, w_up, sizes, interpret=run["interpret"])
        return ops.gmm(h, w_down, sizes, row_scale_m=scale, interpret=run["interpret"])

    return _vjp(op, (x, w_gate, w_up, w_down, scale), ct)


def _recomputes(problems) -> tuple[Problem, ...]:
    return tuple(
        dataclasses.replace(q, options=(("recompute", r),))
        for q in problems
        for r in ops.RECOMPUTES
    )


OPS = [
    ArrayCase(
        name="ops.gmm",
        arrays=("lhs", "rhs", "sizes", "ct_n"),
        kernel=lambda x, w, sizes, ct, *, p, run: _vjp(
            lambda x, w: ops.gmm(x, w, sizes, out_dtype=p.out_dtype, interpret=run["interpret"]),
            (x, w),
            ct,
        ),
        expect=lambda x, w, sizes, ct, *, p, run: _vjp_expect(
            lambda x, w: reference.gmm(x, w, sizes), (x, w), ct, p.out_dtype or x.dtype
        ),
        zeros_past_groups=False,
        interpret=(
            dataclasses.replace(OPS_CASES[1], out_dtype=F32),
            dataclasses.replace(OPS_CASES[0], out_dtype=F32),
            OPS_CASES[0],
        ),
        lowered=(dataclasses.replace(OPS_REAL, out_dtype=F32),),
        gpu=(dataclasses.replace(OPS_REAL, out_dtype=F32), OPS_REAL),
    ),
    ArrayCase(
        name="ops.gmm_dgrad",
        arrays=("lhs", "rhs_t", "sizes", "ct_n"),
        kernel=lambda x, w, sizes, ct, *, p, run: _vjp(
            lambda x, w: ops.gmm(
                x, w, sizes, transpose_rhs=True, out_dtype=p.out_dtype, interpret=run["interpret"]
            ),
            (x, w),
            ct,
        ),
        expect=lambda x, w, sizes, ct, *, p, run: _vjp_expect(
            lambda x, w: reference.gmm(x, w, sizes, transpose_rhs=True),
            (x, w),
            ct,
            p.out_dtype or x.dtype,
        ),
        zeros_past_groups=False,
        interpret=(dataclasses.replace(OPS_CASES[0], out_dtype=F32, fast=True),),
        lowered=(dataclasses.replace(OPS_REAL, out_dtype=F32),),
        gpu=(dataclasses.replace(OPS_REAL, out_dtype=F32),),
    ),
    ArrayCase(
        name="ops.gmm_row_scaled",  # the scale gets a gradient too
        arrays=("lhs", "rhs", "sizes", "scale", "ct_n"),
        kernel=lambda x, w, sizes, scale, ct, *, p, run: _vjp(
            lambda x, w, s: ops.gmm(x, w, sizes, row_scale_m=s, interpret=run["interpret"]),
            (x, w, scale),
            ct,
        ),
        expect=lambda x, w, sizes, scale, ct, *, p, run: _vjp_expect(
            lambda x, w, s: reference.gmm(x, w, sizes) * s[:, None], (x, w, scale), ct, F32
        ),
        zeros_past_groups=False,
        interpret=OPS_CASES[::-1],
        lowered=(OPS_REAL,),
        gpu=(OPS_REAL,),
    ),
    ArrayCase(
        name="ops.gmm_swiglu",
        arrays=("lhs", "rhs", "w_up", "sizes", "ct_n"),
        kernel=lambda x, w_gate, w_up, sizes, ct, *, p, run: _vjp(
            lambda *w: ops.gmm_swiglu(*w, sizes, interpret=run["interpret"]),
            (x, w_gate, w_up),
            ct,
        ),
        expect=lambda x, w_gate, w_up, sizes, ct, *, p, run: _vjp_expect(
            lambda *w: reference.gmm_swiglu(*w, sizes), (x, w_gate, w_up), ct, x.dtype
        ),
        zeros_past_groups=False,
        interpret=OPS_CASES[::-1],
        lowered=(OPS_REAL,),
        gpu=(OPS_REAL,),
    ),
    ArrayCase(
        name="ops.swiglu_mlp",
        arrays=("lhs", "rhs", "w_up", "w_down", "sizes", "ct_k"),
        kernel=_swiglu_mlp,
        expect=_swiglu_mlp_expect,
        zeros_past_groups=False,
        interpret=_recomputes(OPS_CASES[::-1]),
        lowered=_recomputes([OPS_REAL]),
        gpu=_recomputes([OPS_REAL]),
    ),
    ArrayCase(
        name="ops.swiglu_mlp_weighted",
        arrays=("lhs", "rhs", "w_up", "w_down", "sizes", "ct_k", "scale"),
        kernel=_swiglu_mlp,
        expect=_swiglu_mlp_expect,
        zeros_past_groups=False,
        interpret=_recomputes(OPS_CASES),
        lowered=_recomputes([OPS_REAL]),
        gpu=_recomputes([OPS_REAL]),
    ),
    ArrayCase(
        name="ops.gmm_swiglu_then_gmm_row_scaled",
        arrays=("lhs", "rhs", "w_up", "w_down", "sizes", "ct_k", "scale"),
        kernel=_swiglu_then_gmm,
        expect=lambda x, w_gate, w_up, w_down, sizes, ct, scale, *, p, run: _vjp_expect(
            lambda *diff: _mlp_spec(*diff[:4], sizes, diff[4]),
            (x, w_gate, w_up, w_down, scale),
            ct,
            F32,
            compute=BF16,
        ),
        zeros_past_groups=False,
        gpu=(OPS_REAL,),
    ),
]

# ---------------------------------------------------------------------------------------------
# The exchange's kernels: one round's dispatch and return inside shard_map over the expert axis
# (exchange/test_mosaic_gpu.py's harness), against the same round by separate kernels (or, for
# send_rows, the protocol's plan) in what the kernel specifies, round by round.

AXIS = exchange.AXIS
LOWERING_DEVICES = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exchange:
    """One exchange configuration: `num_local` experts and `num_rows` rows a device, a receive
    window of `window` rows in tiles of `tile`; the overlapped kernels' copy programs and copy
    stages, dispatch_down_grad's sides, send_rows's blocks (None: derived), D and F."""

    num_local: int
    num_rows: int
    window: int
    tile: int
    exchange_programs: int = 16
    copy_stages: int = 1
    num_sides: int = 1
    num_blocks: int | None = None
    d_model: int = 2048
    d_ff: int = 768
    fast: bool = False

    @property
    def slots(self) -> int:
        return xp.num_tiles(self.window, self.tile, self.num_local) * self.tile

    def __str__(self) -> str:
        parts = [f"local{self.num_local}", f"rows{self.num_rows}", f"window{self.window}",
                 f"tile{self.tile}", f"programs{self.exchange_programs}",
                 f"stages{self.copy_stages}", f"sides{self.num_sides}",
                 f"d{self.d_model}", f"f{self.d_ff}"]  # fmt: skip
        return "-".join(parts + ([f"blocks{self.num_blocks}"] if self.num_blocks else []))


# What an output of the exchange's kernels promises: "all" its rows; "specified" the buffer
# slots the dispatch specifies (filled or zeroed); "round_rows" the rows of the round, back at
# their source.
SPECIFIED, ALL, ROUND_ROWS = "specified", "all", "round_rows"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExchangeCase:
    """A kernel of the exchange: `harness(p, exchange_programs)` the (body, slots) of the round
    inside shard_map (exchange_programs 0: the same round by separate kernels), its arguments
    `arrays(mesh, p, seed)` (placed, split along the expert axis) with the counts [EP, E] and
    the round index after the first `position` of them; `kinds(p)` what each output promises;
    `reference(mesh, p, counts)` a function of the same arguments that gives the reference's
    outputs (None: the separate kernels); `launch_checks(text, p)` the row's checks of its
    lowering."""

    name: str
    harness: Callable[[Exchange, int], tuple[Callable, int]]
    arrays: Callable[..., tuple]
    position: int
    kinds: Callable[[Exchange], Any]
    launch_checks: Callable[[str, Exchange], None]
    counts_seed: int
    reference: Callable | None = None
    min_rounds: int = 1
    interpret: tuple = ()  # semaphores: GPU interpret mode cannot run these kernels
    lowered: tuple[Exchange, ...] = ()
    gpu: tuple[Exchange, ...] = ()

    def _arguments(self, arrays, counts, round_index) -> tuple:
        return (*arrays[: self.position], counts, round_index, *arrays[self.position :])

    def _jitted(self, mesh, p: Exchange, exchange_programs: int, num_arrays: int):
        body, _ = self.harness(p, exchange_programs)
        split = (P(AXIS),) * num_arrays
        in_specs = self._arguments(split, P(), P())
        out_specs = jax.tree.map(lambda _: P(AXIS), self.kinds(p))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

    def _abstract(self, mesh, p: Exchange) -> tuple:
        """The round's arguments on the lowering's mesh, abstract."""
        split, whole = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
        arrays = tuple(
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=split)
            for a in jax.eval_shape(lambda: self.arrays(mesh, p, 0))
        )
        counts = jax.ShapeDtypeStruct(
            (LOWERING_DEVICES, LOWERING_DEVICES * p.num_local), jnp.int32, sharding=whole
        )
        round_index = jax.ShapeDtypeStruct((), jnp.int32, sharding=whole)
        return self._arguments(arrays, counts, round_index)

    def lower(self, p: Exchange) -> jax.stages.Lowered:
        mesh = jax.make_mesh((LOWERING_DEVICES,), (AXIS,))
        args = self._abstract(mesh, p)
        fn = self._jitted(mesh, p, p.exchange_programs, len(args) - 2)
        return fn.trace(*args).lower(lowering_platforms=("cuda",))

    def check_lowered(self, text: str, p: Exchange) -> None:
        """The row's checks of the launch; and the GPU twin's reference, the same round by
        separate kernels, traces (it runs on a GPU only)."""
        self.launch_checks(text, p)
        if self.reference is None:
            mesh = jax.make_mesh((LOWERING_DEVICES,), (AXIS,))
            args = self._abstract(mesh, p)
            self._jitted(mesh, p, 0, len(args) - 2).trace(*args)

    def runner(self, p: Exchange, *, interpret: bool, devices=None) -> tuple[Callable, Callable]:
        """(run, expected) on a mesh of `devices` (default: every GPU; one GPU: the copies go
        to itself): each round's promised outputs, by the kernel and by the reference."""
        if interpret:
            raise ValueError(f"{self.name} signals its peers: interpret mode cannot run it")
        devices = jax.devices() if devices is None else devices
        mesh = jax.make_mesh((len(devices),), (AXIS,), devices=devices)
        counts_se = exchange.random_counts(self.counts_seed, len(devices), p.num_local, p.num_rows)
        t = xp.traffic(jnp.asarray(counts_se), p.num_local)
        rounds = int(xp.window_rounds(t, p.window))
        assert rounds >= self.min_rounds, rounds
        num_arrays = len(self.arrays(mesh, p, 0))
        kernel = self._jitted(mesh, p, p.exchange_programs, num_arrays)
        if self.reference is None:
            reference_fn = self._jitted(mesh, p, 0, num_arrays)
        else:
            reference_fn = self.reference(mesh, p, counts_se)
        put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, P()))  # noqa: E731

        def promised(fn) -> list:
            outs = []
            for r in range(rounds):
                args = self._arguments(self.arrays(mesh, p, r), put(counts_se), put(jnp.int32(r)))
                outs.append(self._promised(fn(*args), p, counts_se, t, r))
            return outs

        return (lambda: promised(kernel)), (lambda: jax.tree.map(bits, promised(reference_fn)))

    def _promised(self, outputs, p: Exchange, counts_se, t, round_index):
        """What the kernel promises of round `round_index`'s outputs (host arrays)."""
        specified = exchange.specified_slots(
            counts_se, p.num_local, p.num_rows, p.window, p.tile, round_index
        )
        mine = np.stack([
            np.asarray(xp.row_places(t, jnp.int32(s), p.num_rows, p.window, p.tile).round_n)
            == round_index
            for s in range(specified.shape[0])
        ])  # fmt: skip

        def take(kind, a):
            a = np.asarray(a)
            if kind == ALL:
                return a
            mask = specified if kind == SPECIFIED else mine
            return a.reshape(*mask.shape, -1)[mask]

        return jax.tree.map(take, self.kinds(p), outputs)


def _planned(mesh, p: Exchange, counts_se):
    """send_rows's reference: the protocol's plan on the host (the buffers every row fills,
    zeros elsewhere; the rows of the round back in place)."""
    del mesh

    def run(x, counts, round_index):
        del counts
        x_snd = np.asarray(x).reshape(counts_se.shape[0], p.num_rows, -1)
        want, _, _ = exchange.planned_buffers(counts_se, x_snd, p.num_local, p.window, p.tile)
        back = exchange.planned_returns(counts_se, x_snd, p.num_local, p.window, p.tile,
                                        int(round_index))  # fmt: skip
        return want[:, int(round_index)].reshape(-1, x_snd.shape[2]), back.reshape(x.shape)

    return run


def _rows_of(mesh, p: Exchange, seed: int) -> tuple:
    """send_rows's argument: bf16 rows [EP * N, D]."""
    x = jax.random.normal(jax.random.key(seed), (mesh.devices.size * p.num_rows, p.d_model))
    return (jax.device_put(x.astype(BF16), NamedSharding(mesh, P(AXIS))),)


def _check_launch(text: str, *, calls: int, fenced: bool) -> None:
    """`calls` Mosaic GPU kernels, peers addressed through XLA's collective metadata, the
    device barrier kept (invariant 4), counters no operand can share (invariant 5), the
    reader's fence where the kernel loads what peers stored (invariant 6)."""
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == calls
    assert "uses_xla_collective_metadata = true" in text
    assert "skip_device_barrier = false" in text
    exchange.assert_no_operand_can_share_the_counters(text)
    exchange.assert_fences(text, fenced=fenced)


def _counters(text: str, count: int) -> None:
    """The kernel's counters: one set of `count` for the kernel, zeroed before each launch."""
    assert re.search(rf"dims = \[\] : \(tensor<i32>\) -> tensor<{count}xi32>", text)


def _check_send_rows(text: str, p: Exchange) -> None:
    """The dispatch then the return: two kernels; the dispatch's U tile counters, not a set
    per block (what kernel scratch semaphores would be); the return's one counter."""
    _check_launch(text, calls=2, fenced=False)
    num_tiles = xp.num_tiles(p.window, p.tile, p.num_local)
    _counters(text, num_tiles)
    assert f"tensor<{p.num_blocks * num_tiles}xi32>" not in text


def _check_dispatch_swiglu(text: str, p: Exchange) -> None:
    _check_launch(text, calls=1, fenced=True)
    _counters(text, xp.num_tiles(p.window, p.tile, p.num_local))


def _check_dispatch_down_grad(text: str, p: Exchange) -> None:
    """dy, its three sides (two bf16 [S, D], the weights [S, 4] f32) and g [S, F] f32."""
    _check_launch(text, calls=1, fenced=True)
    found = re.search(exchange.DOWN_GRAD_CALL, text)
    assert found and found.groups() == (str(p.slots), str(p.d_model)), found
    assert f"x{p.d_ff}xf32>" in found.group(0)


def _check_down_return(text: str, p: Exchange) -> None:
    """y [S, D] f32 and the rows back; a counter a row tile, a local expert's, the arrivals."""
    _check_launch(text, calls=1, fenced=True)
    assert re.search(
        rf"-> \(tensor<{p.slots}x{p.d_model}xf32>, tensor<{p.num_rows}x{p.d_model}xf32>", text
    )
    block_m = mosaic_gpu.programs_config("scaled", n=p.d_model, dtype=BF16).block_m
    _counters(text, pl.cdiv(p.slots, block_m) + p.num_local + 1)


def _check_dgrad_return(text: str, p: Exchange) -> None:
    """d_buffer [S, D], d_x [N, D] and the routing weights' gradient [N, 4] f32."""
    _check_launch(text, calls=1, fenced=True)
    assert re.search(
        rf"-> \(tensor<{p.slots}x{p.d_model}xbf16>, tensor<{p.num_rows}x{p.d_model}xbf16>, "
        rf"tensor<{p.num_rows}x4xf32>",
        text,
    )
    block_m = mosaic_gpu.programs_config("dgrad", n=p.d_model, dtype=BF16).block_m
    _counters(text, pl.cdiv(p.slots, block_m) + p.num_local + 1)


def _check_dispatch_mlp_return(text: str, p: Exchange) -> None:
    """Counters: a buffer tile each, a row tile of h and of y each, the arrivals. Outputs:
    buffer, side (block_m rows more: the scale is read for whole tiles), h, y, rows back."""
    _check_launch(text, calls=1, fenced=True)
    block_m = mosaic_gpu.programs_config("swiglu", n=p.d_ff, dtype=BF16).block_m
    num_tiles = xp.num_tiles(p.window, p.tile, p.num_local)
    _counters(text, num_tiles + 2 * (pl.cdiv(p.slots, block_m) + p.num_local) + 1)
    assert re.search(
        rf"-> \(tensor<{p.slots}x{p.d_model}xbf16>, tensor<{p.slots + block_m}x4xf32>, "
        rf"tensor<{p.slots}x{p.d_ff}xbf16>, tensor<{p.slots}x{p.d_model}xf32>, "
        rf"tensor<{p.num_rows}x{p.d_model}xf32>",
        text,
    )


def _exchanges(*rows, **fields) -> tuple[Exchange, ...]:
    """Exchanges of (num_local, num_rows, window, tile, exchange_programs, copy_stages,
    num_sides) rows (a prefix of them), each with `fields`."""
    names = [f.name for f in dataclasses.fields(Exchange)]
    return tuple(Exchange(**dict(zip(names, row, strict=False)), **fields) for row in rows)


def _fields(p: Exchange) -> tuple[int, int, int, int]:
    return p.num_local, p.num_rows, p.window, p.tile


# The lowering's sizes: 8 devices, 512 rows and 4 experts a device, a 640-row window in tiles of
# 64; D 2048, F 768 (qwen3's), or 128 and 64 for a fast lowering. The GPU's: the exchange tests'
# (4096 rows in a window of 3072, 200 rows in one of 96, 8 experts a device; few copy programs
# and many).
LOWERED = Exchange(num_local=4, num_rows=512, window=640, tile=64)
# (num_local, num_rows, window, tile, exchange_programs) of the overlapped kernels' GPU twins.
_GPU_EXCHANGES = ((4, 4096, 3072, 64, 16), (3, 200, 96, 8, 1), (8, 4096, 6144, 64, 64))
NARROW = dict(d_model=128, d_ff=64)
EXCHANGE = [
    ExchangeCase(
        name="exchange.send_rows",  # the round's dispatch, then the return of the buffer
        harness=lambda p, _: exchange.dispatch_fn(
            *_fields(p), kernel=True, num_blocks=p.num_blocks, copy_stages=p.copy_stages
        ),
        arrays=_rows_of,
        position=1,
        kinds=lambda p: (SPECIFIED, ROUND_ROWS),
        reference=_planned,
        min_rounds=2,
        launch_checks=_check_send_rows,
        counts_seed=1,
        lowered=tuple(
            dataclasses.replace(LOWERED, num_blocks=132, copy_stages=c, fast=True) for c in (1, 4)
        ),
        gpu=_exchanges(
            (4, 4096, 3072, 64), (3, 200, 96, 8), (4, 4096, 3072, 64, 16, 2), (3, 200, 96, 8, 16, 4)
        ),
    ),
    ExchangeCase(
        name="exchange.dispatch_swiglu",  # the dispatch overlapped with gate/up
        harness=lambda p, programs: exchange.dispatch_swiglu_fn(
            *_fields(p), exchange_programs=programs, copy_stages=p.copy_stages
        ),
        arrays=lambda mesh, p, seed: exchange.dispatch_swiglu_inputs(
            mesh, p.num_local, p.num_rows, p.d_model, p.d_ff, seed=seed
        ),
        position=4,
        kinds=lambda p: (SPECIFIED, SPECIFIED, ALL),
        launch_checks=_check_dispatch_swiglu,
        counts_seed=2,
        lowered=(
            dataclasses.replace(LOWERED, fast=True),
            *(dataclasses.replace(LOWERED, copy_stages=c) for c in (2, 4)),
        ),
        gpu=_exchanges(*_GPU_EXCHANGES, (4, 4096, 3072, 64, 16, 2), (3, 200, 96, 8, 1, 4)),
    ),
    ExchangeCase(
        name="exchange.dispatch_down_grad",  # the backward's dispatch overlapped with dy @ w_down.T
        harness=lambda p, programs: exchange.dispatch_down_grad_fn(
            *_fields(p), exchange_programs=programs, copy_stages=p.copy_stages
        ),
        arrays=lambda mesh, p, seed: exchange.dispatch_down_grad_inputs(
            mesh, p.num_local, p.num_rows, p.d_model, p.d_ff, p.num_sides, seed=seed
        ),
        position=1,
        kinds=lambda p: (SPECIFIED, (SPECIFIED,) * p.num_sides, ALL),
        launch_checks=_check_dispatch_down_grad,
        counts_seed=3,
        lowered=(
            dataclasses.replace(LOWERED, num_sides=3, **NARROW, fast=True),
            *(dataclasses.replace(LOWERED, num_sides=3, copy_stages=c) for c in (1, 4)),
        ),
        gpu=(
            *_exchanges((4, 4096, 3072, 64)),
            *_exchanges(*_GPU_EXCHANGES, (3, 200, 96, 8, 1, 4), num_sides=3),
        ),
    ),
    ExchangeCase(
        name="exchange.down_return",  # the down projection overlapped with the return
        harness=lambda p, programs: exchange.down_return_fn(
            *_fields(p), exchange_programs=programs, copy_stages=p.copy_stages
        ),
        arrays=lambda mesh, p, seed: exchange.down_return_inputs(
            mesh, p.num_local, p.slots, p.d_model, p.d_ff, seed=seed
        ),
        position=3,
        kinds=lambda p: (ALL, ROUND_ROWS),
        launch_checks=_check_down_return,
        counts_seed=2,
        lowered=(
            dataclasses.replace(LOWERED, **NARROW, fast=True),
            *(dataclasses.replace(LOWERED, copy_stages=c) for c in (1, 2, 4)),
        ),
        gpu=_exchanges(*_GPU_EXCHANGES, (4, 4096, 3072, 64, 16, 2), (3, 200, 96, 8, 1, 4)),
    ),
    ExchangeCase(
        name="exchange.dgrad_return",  # the input gradient overlapped with its return
        harness=lambda p, programs: exchange.dgrad_return_fn(
            *_fields(p), exchange_programs=programs
        ),
        arrays=lambda mesh, p, seed: exchange.dgrad_return_inputs(
            mesh, p.num_local, p.slots, p.d_model, p.d_ff, num_sides=1, seed=seed
        ),
        position=3,
        kinds=lambda p: (ALL, ROUND_ROWS, (ROUND_ROWS,)),
        launch_checks=_check_dgrad_return,
        counts_seed=4,
        lowered=(dataclasses.replace(LOWERED, **NARROW, fast=True), LOWERED),
        gpu=_exchanges(*_GPU_EXCHANGES),
    ),
    ExchangeCase(
        name="exchange.dispatch_mlp_return",  # the round's whole forward in one kernel
        harness=lambda p, programs: exchange.forward_fn(
            *_fields(p), exchange_programs=programs, copy_stages=p.copy_stages
        ),
        arrays=lambda mesh, p, seed: exchange.forward_inputs(
            mesh, p.num_local, p.num_rows, p.d_model, p.d_ff, seed=seed
        ),
        position=5,
        kinds=lambda p: (SPECIFIED, SPECIFIED, ALL, ALL, ROUND_ROWS),
        launch_checks=_check_dispatch_mlp_return,
        counts_seed=5,
        lowered=(
            dataclasses.replace(LOWERED, **NARROW, fast=True),
            *(dataclasses.replace(LOWERED, copy_stages=c) for c in (1, 4)),
        ),
        gpu=_exchanges(*_GPU_EXCHANGES, (4, 4096, 3072, 64, 24, 4)),
    ),
]

# ---------------------------------------------------------------------------------------------
# The router's forward kernel (routing/mosaic_gpu.py): tokens in, their experts, weights and
# per-tile sums out. Its result is the reference's where no token has a near tie between two
# experts (two f32 logits of different summation orders may rank those either way):
# test_mosaic_gpu.assert_routed_matches.


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterProblem:
    """T tokens of width D routed by `spec`; `fast` keeps it in the fast tier."""

    t: int
    d: int
    spec: RouterSpec
    seed: int = 0
    fast: bool = False

    def __str__(self) -> str:
        s = self.spec
        groups = f"-groups{s.topk_groups}of{s.num_groups}" if s.num_groups else ""
        return f"{self.t}x{self.d}-e{s.num_experts}k{s.top_k}-{s.score_fn}{groups}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _RoutedExpect(Expect):
    """The whole `Routed` result against the reference's (see assert_routed_matches)."""

    want: Any = None
    bias: Any = None
    spec: Any = None

    def check(self, out) -> None:
        router_tests.assert_routed_matches(out, self.want, self.bias, self.spec)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterCase:
    name: str
    interpret: tuple[RouterProblem, ...] = ()
    lowered: tuple[RouterProblem, ...] = ()
    gpu: tuple[RouterProblem, ...] = ()

    @staticmethod
    def inputs(p: RouterProblem) -> tuple:
        return router_tests.inputs(p.t, p.d, p.spec.num_experts, seed=p.seed)

    def lower(self, p: RouterProblem) -> jax.stages.Lowered:
        x, w, b = jax.eval_shape(lambda: self.inputs(p))
        call = functools.partial(router.route, spec=p.spec)
        return jax.jit(call).trace(x, w, b).lower(lowering_platforms=("cuda",))

    def check_lowered(self, text: str, p: RouterProblem) -> None:
        del p
        assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1, "one kernel"
        assert "scatter" not in text, "the router scatters"

    def runner(self, p: RouterProblem, *, interpret: bool) -> tuple[Callable, Callable]:
        x, w, b = self.inputs(p)
        call = functools.partial(router.route, spec=p.spec, interpret=interpret)
        call = call if interpret else jax.jit(call)

        def expected():
            want = router_reference.route(x, w, b, p.spec, tile=router.TILE)
            return _RoutedExpect(want=want, bias=b, spec=p.spec)

        return (lambda: call(x, w, b)), expected


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterGradCase(RouterCase):
    """The router's op (routing/ops.py): x's and the router's gradients from random cotangents
    of the weights, the lse and the share sums, by the backward kernel, against the reference's
    function of the tokens with the kernel's experts held fixed (dx to its bf16 rounding, the
    router's gradient to f32's)."""

    @staticmethod
    def cotangents(p: RouterProblem) -> tuple:
        keys = jax.random.split(jax.random.key(50 + p.seed), 3)
        tiles, e = -(-p.t // router.TILE), p.spec.num_experts
        shapes = ((p.t, p.spec.top_k), (p.t,), (tiles, e))
        return tuple(jax.random.normal(k, s, F32) for k, s in zip(keys, shapes, strict=True))

    @staticmethod
    def grads(x, w, b, cts, *, spec, interpret=False):
        def outputs(x, w):
            routed = router_ops.route(x, w, b, spec, interpret=interpret)
            return routed.weights_tk, routed.lse_t, routed.shares_ue

        return jax.vjp(outputs, x, w)[1](cts)

    def lower(self, p: RouterProblem) -> jax.stages.Lowered:
        args = jax.eval_shape(lambda: (*self.inputs(p), self.cotangents(p)))
        call = functools.partial(self.grads, spec=p.spec)
        return jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))

    def check_lowered(self, text: str, p: RouterProblem) -> None:
        del p
        assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2, "forward and backward"
        assert "scatter" not in text, "the router's backward scatters"

    def runner(self, p: RouterProblem, *, interpret: bool) -> tuple[Callable, Callable]:
        x, w, b = self.inputs(p)
        cts = self.cotangents(p)
        call = functools.partial(self.grads, spec=p.spec, interpret=interpret)
        call = call if interpret else jax.jit(call)

        def expected():
            experts = router.route(x, w, b, p.spec, interpret=interpret).experts_tk

            def outputs(x, w):
                logits = router_reference.f32_logits(x, w)
                scores = router_reference.router_scores(logits, p.spec)
                shares = router_reference.score_shares(scores)
                return (
                    router_reference.chosen_weights(scores, experts, p.spec),
                    jax.nn.logsumexp(logits, axis=-1),
                    router_reference.tile_sums(shares, router.TILE),
                )

            dx, dw = jax.vjp(outputs, x, w)[1](cts)
            return (close(dx, BF16), close(dw, F32))

        return (lambda: call(x, w, b, cts)), expected


_QWEN3 = RouterSpec(num_experts=128, top_k=8)
_DSV3 = RouterSpec(
    num_experts=256, top_k=8, score_fn="sigmoid", norm_topk_prob=True, routed_scaling=2.5,
    num_groups=8, topk_groups=4,
)  # fmt: skip
_MIXTRAL = RouterSpec(num_experts=8, top_k=2)
_ROUTER_REAL = (
    RouterProblem(t=16384, d=2048, spec=_QWEN3),
    RouterProblem(t=4096, d=7168, spec=_DSV3),
    RouterProblem(t=8192, d=4096, spec=_MIXTRAL),
)
ROUTER = [
    RouterCase(
        name="router",
        interpret=(
            RouterProblem(t=200, d=128, spec=_QWEN3, fast=True),
            RouterProblem(t=130, d=64, spec=_DSV3, fast=True),
            RouterProblem(t=64, d=128, spec=_MIXTRAL),
        ),
        lowered=(dataclasses.replace(_ROUTER_REAL[0], fast=True), *_ROUTER_REAL[1:]),
        gpu=_ROUTER_REAL,
    ),
    RouterGradCase(
        name="router_grads",
        interpret=(
            RouterProblem(t=130, d=64, spec=_DSV3, fast=True),
            RouterProblem(t=200, d=128, spec=_QWEN3),
        ),
        lowered=(dataclasses.replace(_ROUTER_REAL[0], fast=True), *_ROUTER_REAL[1:]),
        gpu=_ROUTER_REAL,
    ),
]

# ---------------------------------------------------------------------------------------------
# The table and the three contracts.

TABLE = [*GROUPED_GEMMS, *GATHERED_ROWS, *WEIGHT_GRADIENT, *OPS, *EXCHANGE, *ROUTER]


def _params(contract: str, *, tiers: bool = True) -> list:
    """(case, problem) of every row's problems under `contract`; those not `fast` marked slow
    (`tiers`)."""
    return [
        pytest.param(
            case,
            problem,
            id=f"{case.name}-{problem}",
            marks=() if problem.fast or not tiers else pytest.mark.slow,
        )
        for case in TABLE
        for problem in getattr(case, contract)
    ]


def test_every_row_names_its_kernel_once():
    names = [case.name for case in TABLE]
    assert len(set(names)) == len(names), names


@pytest.mark.parametrize(("case", "problem"), _params("lowered"))
def test_lowers_for_cuda(case, problem):
    text = case.lower(problem).as_text()
    assert re.search(r"custom_call @mosaic_gpu", text), "no Mosaic GPU kernel in the lowering"
    case.check_lowered(text, problem)


@pytest.mark.parametrize(("case", "problem"), _params("interpret"))
def test_interpret_mode_result_equals_the_reference(case, problem):
    run, expected = case.runner(problem, interpret=True)
    assert_meets(run(), expected())


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "problem"), _params("gpu", tiers=False))
def test_gpu_twin_equals_the_reference_and_repeats_its_bits(case, problem):
    run, expected = case.runner(problem, interpret=False)
    first = run()
    for _ in range(2):
        chex.assert_trees_all_equal(run(), first)
    assert_meets(first, expected())


@pytest.mark.slow
def test_the_exchange_twin_holds_the_spec_to_the_plan_on_this_machine():
    """The exchange's GPU twins' round loop, masks and send_rows's planned reference, run here
    with the spec (reference.send_rows, plain JAX) in the kernel's place on 8 CPU devices: the
    rows the dispatch specifies and the rows back are the plan's, round by round (2 of the CPU
    devices)."""
    (send_rows,) = [case for case in EXCHANGE if case.name == "exchange.send_rows"]
    spec = dataclasses.replace(
        send_rows,
        harness=lambda p, _: exchange.dispatch_fn(*_fields(p), kernel=False),
    )
    problem = Exchange(num_local=2, num_rows=24, window=24, tile=4, d_model=16)
    run, expected = spec.runner(problem, interpret=False, devices=jax.devices()[:2])
    outputs = run()
    assert len(outputs) >= 2  # rounds
    assert_meets(outputs, expected())
