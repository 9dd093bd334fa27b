"""Tile-config sweep of our grouped GEMMs on the H200, each against torch._grouped_mm (issue 4).

    PYTHONPATH=. python3 -m bench.gmm_sweep --out DIR [--budget-s 200]

For the five DESIGN.md shapes (bench/grouped_gemm_h200.py's uniform-routing shapes) and the
products forward (`mosaic_gpu.gmm`), forward fused SwiGLU (`gmm_swiglu`, gate_up shapes only),
dgrad (`gmm(..., transpose_rhs=True)`) and wgrad (`mosaic_gpu_wgrad.tgmm`, bf16 out), each
(product, shape) pair times torch._grouped_mm (the yardstick) and a list of candidate
TileConfigs: the current default first, then the candidates of `candidates()`, each with the
reason it is in the list. Every run is built, checked (against torch's output on every element
and reference.py on a few groups), run again and compared bitwise, then timed: all by
bench/grouped_gemm_h200.py's own `run_candidate` (same check, same timing method: median of
>= 10 samples of back-to-back calls between two syncs). With --paired (the default) every run
of ours is timed in alternation with torch (`grouped_gemm_h200.time_paired`) and its x torch is
the median of the per-pair ratios torch_i / ours_i.

Order: pass 0 runs torch and the default of every pair, pass i the i-th candidate of every pair,
so a run cut short (the --budget-s clock stops starting runs) still covers every pair. After every
run it rewrites DIR/sweep.json (every run: config, check, median ms, TFLOP/s, ratio to torch and
to the default) and DIR/sweep.md (the best passing config per pair, then every run).
`bench.grouped_gemm_h200 --configs DIR/sweep.json` then times the best configs.

--smoke (CPU): one tiny shape, our kernels in GPU interpret mode, two candidates a pair.
"""

from __future__ import annotations

import os

# torch shares the GPU with JAX in this process (as in grouped_gemm_h200, set before jax starts).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.80")

import argparse
import dataclasses
import functools
import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from bench import grouped_gemm_h200 as gg
from pallas_kernels.grouped_matmul import mosaic_gpu, mosaic_gpu_wgrad, tuning
from pallas_kernels.grouped_matmul.tuning import TileConfig

PRODUCTS = ("forward", "wgrad", "dgrad", "swiglu")  # pass order within a pass
SHAPES = tuple(s for s in gg.SHAPES if s.routing == "uniform")  # DESIGN.md's five
SMOKE_SHAPES = tuple(s for s in gg.SMOKE_SHAPES if s.routing == "uniform")
DEFAULT_LABEL = "default"
DEVICE_COMMAND = "PYTHONPATH=. python3 -m bench.gmm_sweep --out $OUT --budget-s S"


@dataclasses.dataclass(frozen=True)
class Trial:
    """One candidate config of one (product, shape) pair."""

    label: str
    config: TileConfig
    why: str


# ---------------------------------------------------------------------------------------------
# Candidates


def default_config(product: str, shape: gg.Shape, *, interpret: bool) -> TileConfig:
    """The config our kernel runs for this pair when given config=None."""
    if product == "wgrad":  # tgmm runs the table's H200 tiles in interpret mode too
        return mosaic_gpu_wgrad.default_config(shape.k, shape.n)
    if product == "swiglu":
        return mosaic_gpu.default_config(n=shape.n // 2, swiglu=True, interpret=interpret)
    if product == "dgrad":
        return mosaic_gpu.default_config(n=shape.k, transpose_rhs=True, interpret=interpret)
    return mosaic_gpu.default_config(n=shape.n, interpret=interpret)


def candidates(product: str, shape: gg.Shape, *, smoke: bool = False) -> list[Trial]:
    """The default, then the configs worth timing for this pair, most promising first.

    H200 facts behind the list: 132 SMs; 227 KiB of shared memory a block (226 usable here);
    a 128x256x64 bf16 stage is 48 KiB, so 4 stages plus 32 KiB of epilogue buffers fill it;
    each consumer warpgroup holds block_m x block_n/2 f32 accumulators (128x128 = 128 registers
    a thread), so 128x256 is the largest output tile. The tile counts over the 132 SMs are 35 to
    217 waves at these shapes (under 2% lost to the last partial wave), so the grid size is not
    swept. The G=128 shapes have ~1024-row groups: ~1 partial row tile per group (~6% of the
    row tiles at block_m=128).
    """
    base = default_config(product, shape, interpret=smoke)
    out = [Trial(DEFAULT_LABEL, base, "the defaults table (tuning.py), as the kernel runs it")]

    def add(label: str, why: str, **changes):
        try:
            config = dataclasses.replace(base, **changes)
        except ValueError as e:  # a combination TileConfig refuses: say so in the record
            raise ValueError(f"candidate {label} for {product} {shape.name}: {e}") from e
        if config != base and all(t.config != config for t in out):
            out.append(Trial(label, config, why))

    if smoke:
        # Two cheap candidates a pair: the sweep's machinery, not a measurement.
        if product == "wgrad":
            add(
                "one_consumer",
                "smoke: one consumer warpgroup",
                block_n=64,
                num_consumers=1,
                epi_block_n=64,
            )
        else:
            add("order_m2", "smoke: another tile order", grid_minor_dim="m", grid_tile_width=2)
        return out

    if product in ("forward", "dgrad", "swiglu"):
        n_out = {"forward": shape.n, "dgrad": shape.k, "swiglu": shape.n // 2}[product]
        if (n_out // base.block_n) % 2 == 0:
            add(
                "cluster2",
                "clusters of 2 CTAs on neighbouring column tiles, each lhs tile loaded once "
                "and multicast into both: 128x256 tiles read 3/256 B of L2 per FLOP, ~7.6 TB/s "
                "at 650 TFLOP/s; the multicast makes it 1/128 (~5 TB/s), as CUTLASS's 2x1 "
                "clusters do",
                cluster_n=2,
            )
        if (n_out // base.block_n) % 2 == 0:
            add(
                "cluster_2x2",
                "clusters of 2 x 2 CTAs, each lhs tile multicast along the cluster's columns "
                "and each rhs tile along its rows: half the L2 reads of one CTA (1.5/256 B per "
                "FLOP), for the row waste of cluster_m2 (groups tiled in 256 rows)",
                cluster_m=2,
                cluster_n=2,
            )
        add(
            "cluster_m2",
            "clusters of 2 CTAs on the two 128-row halves of a 256-row tile of one group, "
            "each rhs tile (64 x 256, twice the lhs tile) loaded once and multicast into both: "
            "2/256 B of L2 per FLOP instead of 3/256; what torch._grouped_mm's CUTLASS kernel "
            "runs (cooperative 128x256x64, cluster 2x1 along M); costs a group's rows rounded "
            "up to 256 instead of 128",
            cluster_m=2,
        )
        add(
            "cluster_m2_split_m",
            "cluster_m2 with the consumers splitting the tile's rows (split_m)",
            cluster_m=2,
            consumer_dim="m",
        )
        if (n_out // base.block_n) % 2 == 0:
            add(
                "cluster2_split_m",
                "cluster2 (lhs multicast) with the consumers splitting the tile's rows",
                cluster_n=2,
                consumer_dim="m",
            )
        add(
            "split_m",
            "consumers split the tile's rows, not its columns: each runs m64 x n256 wgmma "
            "(m64 x n128 for swiglu's two products) reading its 64 lhs rows once a step, where "
            "the column split runs twice as many m64 x n128 (n64) instructions that each "
            "re-read all 128 rows: less shared-memory traffic per FLOP (what CUTLASS's "
            "cooperative 128x256 kernels do)",
            consumer_dim="m",
        )
        add(
            "dr0",
            "delay_release=0: each stage released as soon as its wgmma finished (609 vs 599 "
            "with order n1 at qwen3 gate_up forward)",
            delay_release=0,
        )
        if product == "forward" and shape.g >= 64:
            add(
                "bm64",
                "block_m=64: half the wasted rows in each group's partial last tile (~1024-"
                "row groups), at the cost of more L2 traffic per FLOP",
                block_m=64,
            )
    elif product == "wgrad":
        # K tiles are tgmm's output rows ("m").
        if -(-shape.k // base.block_m) % 2 == 0:
            add(
                "cluster_m2",
                "clusters of 2 CTAs on K tiles 2j, 2j + 1 of one (group, N tile): each block "
                "of dout rows (64 x 256, twice the lhs block) loaded once and multicast into "
                "both; unlike the forward's cluster_m no group is padded",
                cluster_m=2,
            )
        add(
            "order_m32",
            "bands of 32 K tiles (all of K at mixtral: K tiles fastest): the model's least HBM "
            "traffic at mixtral (134 MB a group, the ideal) while a group's 16.8 MB lhs slice "
            "stays in L2; 610 MB if under ~20 MiB of L2 is left for it",
            grid_minor_dim="m",
            grid_tile_width=32,
        )
        add(
            "order_m8",
            "bands of 8 K tiles: half the default's lhs slice in L2 per band, twice the bands "
            "(model at mixtral: 354-588 MB a group vs 216-263 for m/16)",
            grid_minor_dim="m",
            grid_tile_width=8,
        )
        add(
            "dr1",
            "delay_release=1: one wgmma kept in flight, each stage released a step later (the "
            "ring over a CTA's units allows it; the per-unit pipeline did not)",
            delay_release=1,
        )
        add(
            "t128x128_s4",
            "output tile 128x128, 4 stages: the default before 128x256 x 3 stages (which beat it "
            "at all five shapes in the 2026-11-30 probe, with the rows repacked)",
            block_n=128,
            max_concurrent_steps=4,
        )
        add(
            "t128x256_s4",
            "output tile 128x256 with a 4th stage (224 KiB with a bf16 epilogue; f32 out would "
            "not fit, hence not the default)",
            block_n=256,
            max_concurrent_steps=4,
        )
        add(
            "t128x256_r128_s2",
            "128 rows a step (block_k=128), 2 stages: half the steps of a ~1024-row group, the "
            "same bytes in flight",
            block_n=256,
            block_k=128,
            max_concurrent_steps=2,
        )
        add(
            "t128x256_s3_epi128",
            "tile 128x256, 3 stages, epilogue 64x128 (half as many TMA stores per unit)",
            block_n=256,
            max_concurrent_steps=3,
            epi_block_n=128,
        )
    return out


def fits(product: str, shape: gg.Shape, config: TileConfig) -> str | None:
    """Why `config` cannot run this pair (None: it can), without building it."""
    if product == "wgrad":
        tiles = {"K": (shape.k, config.block_m), "N": (shape.n, config.block_n)}
        need = config.smem_bytes(itemsize=2, out_itemsize=2)
    else:
        n = {"forward": shape.n, "dgrad": shape.k, "swiglu": shape.n // 2}[product]
        k = shape.n if product == "dgrad" else shape.k
        tiles = {"K": (k, config.block_k), "N": (n, config.block_n)}
        need = config.smem_bytes(
            itemsize=2, out_itemsize=2, num_rhs=2 if product == "swiglu" else 1
        )
    for name, (size, block) in tiles.items():
        if size % block:
            return f"{name}={size} is not a multiple of its block {block}"
    limit = tuning.DEVICES[tuning.resolve_device_kind()].smem_bytes
    if need > limit:
        return f"needs {need} bytes of shared memory, {limit} available"
    return None


# ---------------------------------------------------------------------------------------------
# Our kernels: (product) -> the jitted function and its arguments. Tests swap this table.


def _forward(p: gg.Problem, config: TileConfig, interpret: bool):
    return functools.partial(mosaic_gpu.gmm, config=config, interpret=interpret), (p.x, p.w, p.gs)


def _dgrad(p: gg.Problem, config: TileConfig, interpret: bool):
    fn = functools.partial(mosaic_gpu.gmm, transpose_rhs=True, config=config, interpret=interpret)
    return fn, (p.dout, p.w, p.gs)


def _wgrad(p: gg.Problem, config: TileConfig, interpret: bool):
    fn = functools.partial(
        mosaic_gpu_wgrad.tgmm, out_dtype=jnp.bfloat16, config=config, interpret=interpret
    )
    return fn, (p.x, p.dout, p.gs)


def _swiglu(p: gg.Problem, config: TileConfig, interpret: bool):
    fn = functools.partial(mosaic_gpu.gmm_swiglu, config=config, interpret=interpret)
    return fn, (p.x, p.w_gate, p.w_up, p.gs)


KERNELS: dict[str, Callable[[gg.Problem, TileConfig, bool], tuple[Callable, tuple]]] = {
    "forward": _forward,
    "dgrad": _dgrad,
    "wgrad": _wgrad,
    "swiglu": _swiglu,
}
KERNEL_NAMES = {
    "forward": "mosaic_gpu.gmm",
    "dgrad": "mosaic_gpu.gmm(transpose_rhs=True)",
    "wgrad": "mosaic_gpu_wgrad.tgmm (bf16 out)",
    "swiglu": "mosaic_gpu.gmm_swiglu",
}


# ---------------------------------------------------------------------------------------------
# The sweep


@dataclasses.dataclass
class Pair:
    product: str
    shape: gg.Shape
    trials: list[Trial]
    record: dict  # what goes into sweep.json
    full: tuple | None = None  # all-elements reference (torch's checked output, or XLA's)
    subsets: tuple | None = None
    torch_runner: gg.Runner | None = None  # torch, checked and timed: --paired times with it


class Sweep:
    def __init__(self, args, torch_mod):
        self.args, self.torch = args, torch_mod
        self.clock = gg.Clock(args.budget_s)
        self.interpret = args.smoke and jax.default_backend() != "gpu"
        self.problems: dict[str, gg.Problem] = {}
        self.pairs: list[Pair] = []
        for product in args.products:
            for shape in args.shape_list:
                if product == "swiglu" and not shape.gate_up:
                    continue
                trials = candidates(product, shape, smoke=args.smoke)
                trials = trials[: args.max_candidates + 1]
                flops, _ = gg.product_cost(shape, product)
                record = {
                    "product": product,
                    "shape": shape.name,
                    "mknG": [shape.m, shape.k, shape.n, shape.g],
                    "kernel": KERNEL_NAMES[product],
                    "flops": flops,
                    "torch": None,
                    "runs": [],
                }
                self.pairs.append(Pair(product, shape, trials, record))
        smoke_note = "; SMOKE RUN (tiny shape, interpret mode): no number means anything"
        self.results: dict[str, Any] = {
            "environment": gg.environment(torch_mod, args),
            "method": (
                "bench/grouped_gemm_h200.run_candidate for every run: checked against torch "
                "(all elements; without torch: XLA ragged_dot / reference.tgmm on a CPU, none "
                "on a GPU) and "
                "reference.py f32 on the first/middle/last/largest groups, |err| <= 2^-6 "
                f"(|ref| + rms ref); {args.repeats} runs compared bitwise; {args.warmup} "
                f"warm-up + 1 calibration call, then the median of {args.timed} samples of >= "
                f"{args.sample_s * 1e3:.0f} ms (back-to-back calls between two syncs, host "
                "clock); TFLOP/s = 2*M*K*N / median; uniform routing, seed 0"
                + (
                    "; --paired: each run of ours timed in alternation with torch (sample i of "
                    "torch, then sample i of ours, same method), x torch = the median of the "
                    "per-pair ratios torch_i / ours_i [25th-75th percentile], x default = a "
                    "run's x torch over the default's, the best run = the highest x torch; "
                    "the ratio of separately timed medians kept as x torch unpaired"
                    if args.paired
                    else ""
                )
                + (smoke_note if args.smoke else "")
            ),
            "args": {
                k: (str(v) if isinstance(v, pathlib.Path) else v)
                for k, v in vars(args).items()
                if k != "shape_list"
            },
            "pairs": [pair.record for pair in self.pairs],
        }
        self.results["environment"]["command"] = "python3 -m bench.gmm_sweep " + " ".join(args.argv)
        self.results["environment"]["device_command"] = DEVICE_COMMAND

    def problem(self, shape: gg.Shape) -> gg.Problem:
        if shape.name not in self.problems:
            self.problems[shape.name] = gg.make_problem(shape, self.torch)
        return self.problems[shape.name]

    def run(self) -> dict:
        depth = max(len(pair.trials) for pair in self.pairs) if self.pairs else 0
        for index in range(depth):
            for pair in self.pairs:
                if index == 0:
                    self._run_torch(pair)
                if index < len(pair.trials):
                    self._run_trial(pair, pair.trials[index])
        self.save()
        return self.results

    def _prepare(self, pair: Pair, rec: dict) -> gg.Problem | None:
        """The pair's inputs and reference subsets; None (with the reason in `rec`) if they
        cannot be made: the sweep goes on with the other pairs."""
        try:
            p = self.problem(pair.shape)
            if pair.subsets is None:
                pair.subsets = gg.subset_reference(p, pair.product, cap=self.args.subset_rows)
        except Exception as e:  # e.g. out of memory: recorded, not fatal
            rec["status"] = f"error preparing the pair: {type(e).__name__}: {e}"[:1500]
            return None
        return p

    def _full(self, pair: Pair, p: gg.Problem) -> tuple | None:
        """torch's checked output; without it, XLA's on a CPU (tiny shapes) and none on a GPU
        (reference.tgmm in f32 over every group is far too slow at real sizes): then only the
        reference.py subsets check the run."""
        if pair.full is None and jax.default_backend() != "gpu":
            pair.full = gg.full_reference(p, pair.product)
            pair.record["full_reference"] = "xla ragged_dot / reference.tgmm in f32 (no torch)"
        elif pair.full is None:
            pair.record["full_reference"] = "none (torch did not pass): reference.py subsets only"
        return pair.full

    def _run_torch(self, pair: Pair) -> None:
        if not self.clock.allows_anything():
            pair.record["torch"] = {"status": self._skipped()}
            self.save()
            return
        failure: dict[str, Any] = {}
        p = self._prepare(pair, failure)
        if p is None:
            pair.record["torch"] = failure
            self.save()
            return
        (cand,) = gg.Bench(self.args, p).torch_candidates(pair.product)
        keep: dict[str, Any] = {}
        rec, outs = gg.run_candidate(
            cand,
            product=pair.product,
            full=None,
            subsets=pair.subsets,
            sizes=p.sizes,
            args=self.args,
            clock=self.clock,
            keep=keep,
        )
        self._summarize(pair, rec)
        pair.record["torch"] = rec
        if rec.get("check", {}).get("ok"):
            pair.full = outs
            pair.record["full_reference"] = "torch (this pair's checked output)"
            if self.args.paired and "timing" in rec:
                pair.torch_runner = keep.get("runner")
        del outs, keep
        self.save()

    def _run_trial(self, pair: Pair, trial: Trial) -> None:
        rec: dict[str, Any] = {
            "label": trial.label,
            "why": trial.why,
            "config": dataclasses.asdict(trial.config),
        }
        pair.record["runs"].append(rec)
        if not self.clock.allows_anything():
            rec["status"] = self._skipped()
            self.save()
            return
        refused = fits(pair.product, pair.shape, trial.config)
        if refused is not None:
            rec["status"] = f"not run: {refused}"
            self.save()
            return
        p = self._prepare(pair, rec)
        if p is None:
            self.save()
            return
        full = self._full(pair, p)

        def build():
            fn, operands = KERNELS[pair.product](p, trial.config, self.interpret)
            return gg.jax_runner(fn, *operands)

        cand = gg.Candidate(f"ours {trial.label}", "ours", build, config=repr(trial.config))
        result, outs = gg.run_candidate(
            cand,
            product=pair.product,
            full=full,
            subsets=pair.subsets,
            sizes=p.sizes,
            args=self.args,
            clock=self.clock,
            paired_with=pair.torch_runner,
        )
        del outs
        result.pop("name", None)
        result.pop("family", None)
        result.pop("extra", None)
        result.pop("config", None)
        rec.update(result)
        self._summarize(pair, rec)
        self.save()

    def _skipped(self) -> str:
        return f"skipped: time budget ({self.clock.elapsed():.0f} s of {self.clock.budget_s:.0f})"

    def _summarize(self, pair: Pair, rec: dict) -> None:
        """Flat fields of a run: ok, median_ms, tflops, x_torch, x_default; paired runs also
        x_torch_unpaired (the ratio of the medians) and x_torch_p25_p75, and their x_torch is
        the paired one (x_default then the ratio of the two runs' paired x_torch: each against
        torch timed beside it)."""
        rec["ok"] = bool(rec.get("check", {}).get("ok")) and "timing" in rec
        if "timing" in rec:
            ms = rec["timing"]["median_ms"]
            rec["median_ms"] = ms
            rec["tflops"] = pair.record["flops"] / (ms * 1e-3) / 1e12
            torch_ms = (pair.record.get("torch") or {}).get("median_ms")
            if torch_ms:
                rec["x_torch"] = torch_ms / ms
            if "x_torch_paired" in rec:
                rec["x_torch_unpaired"] = rec.get("x_torch")
                rec["x_torch"] = rec["x_torch_paired"]
                rec["x_torch_p25_p75"] = rec["x_torch_paired_p25_p75"]
            default = next(
                (
                    r
                    for r in pair.record["runs"]
                    if r["label"] == DEFAULT_LABEL and "median_ms" in r
                ),
                None,
            )
            if default is not None and rec is not default:
                if "x_torch_paired" in rec and "x_torch_paired" in default:
                    rec["x_default"] = rec["x_torch_paired"] / default["x_torch_paired"]
                else:
                    rec["x_default"] = default["median_ms"] / ms
        best = best_run(pair.record)
        if best is None:
            pair.record["best"] = None
        else:
            keys = (
                "label",
                "config",
                "median_ms",
                "tflops",
                "x_torch",
                "x_torch_p25_p75",
                "x_torch_unpaired",
                "x_default",
            )
            pair.record["best"] = {k: best[k] for k in keys if k in best}
        _print_run(pair, rec)

    def save(self) -> None:
        self.results["elapsed_s"] = round(self.clock.elapsed(), 1)
        out = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(self.results, indent=1, default=str))
        (out / "sweep.md").write_text(render_markdown(self.results))


def _default_run(pair_record: dict) -> dict | None:
    return next((r for r in pair_record["runs"] if r["label"] == DEFAULT_LABEL), None)


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
    """{(product, shape name): {"config": TileConfig, "label", "median_ms", ...}} from a
    sweep.json's contents: each pair's fastest passing, bitwise-repeatable config."""
    out = {}
    for record in sweep.get("pairs", []):
        best = best_run(record)
        if best is None:
            continue
        out[(record["product"], record["shape"])] = {
            "config": TileConfig(**best["config"]),
            "label": best["label"],
            "median_ms": best["median_ms"],
            "x_torch": best.get("x_torch"),
        }
    return out


def _print_run(pair: Pair, rec: dict) -> None:
    name = rec.get("label", "torch")
    where = f"{pair.product:8s} {pair.shape.name:16s} {name:20s}"
    if "median_ms" in rec:
        extra = "".join(
            f" {rec[k]:.3f}{k.removeprefix('x_')}" for k in ("x_torch", "x_default") if k in rec
        )
        print(
            f"  {where} {rec['median_ms']:8.3f} ms {rec['tflops']:7.1f} TFLOP/s{extra} "
            f"[{'ok' if rec['ok'] else 'FAILED'}; t={pair_elapsed(rec)}]",
            flush=True,
        )
    else:
        print(f"  {where} {str(rec.get('status'))[:200]}", flush=True)


def pair_elapsed(rec: dict) -> str:
    return f"{rec.get('t_end_s', 0):.0f}s"


# ---------------------------------------------------------------------------------------------
# Markdown


def _cell(rec: dict | None, key: str, fmt: str) -> str:
    if not rec or key not in rec or rec[key] is None:
        return "-"
    return format(rec[key], fmt)


def _x_torch_cell(rec: dict | None) -> str:
    """x torch; a paired one with its 25th-75th percentile."""
    if not rec or rec.get("x_torch") is None:
        return "-"
    if "x_torch_p25_p75" not in rec:
        return f"{rec['x_torch']:.3f}"
    lo, hi = rec["x_torch_p25_p75"]
    return f"{rec['x_torch']:.3f} [{lo:.3f}-{hi:.3f}]"


def _config_brief(config: dict, base: dict | None) -> str:
    if base is None:
        return ", ".join(f"{k}={v}" for k, v in config.items())
    changed = {k: v for k, v in config.items() if base.get(k) != v}
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "(the default)"


def _status(rec: dict) -> str:
    if rec.get("ok"):
        bits = rec.get("bitwise_repeatable", {}).get("identical")
        return "ok" if bits else "ok, **NOT bitwise repeatable**"
    if "check" in rec and not rec["check"].get("ok"):
        return "**failed check**"
    return str(rec.get("status", "-")).replace("|", "/")[:160]


def render_markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        "# Tile-config sweep of our grouped GEMMs against torch._grouped_mm",
        "",
        f"- command: `{env['command']}` (device: `{env['device_command']}`)",
        f"- date (UTC): {env['date_utc']}; device: {env['device']} ({env['backend']}); "
        f"jax {env['jax']}, torch {env['torch']}; git {env['git_commit']}",
        f"- method: {results['method']}",
        f"- elapsed: {results.get('elapsed_s', '-')} s",
        "",
        "## Best passing config per (product, shape)",
        "",
        "x torch: paired where it shows a [25th-75th percentile] (the median of torch_i / "
        "ours_i over samples timed in alternation), else torch's median over ours, timed "
        "apart (x torch unpaired in 'Every run').",
        "",
        "| product | shape | torch ms | default ms | default x torch | best | best ms "
        "| best x torch | best x default | best config (changes from the default) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for pair in results["pairs"]:
        default = _default_run(pair)
        best = best_run(pair)
        base = default["config"] if default else None
        lines.append(
            f"| {pair['product']} | {pair['shape']} | {_cell(pair['torch'], 'median_ms', '.3f')} "
            f"| {_cell(default, 'median_ms', '.3f')} | {_x_torch_cell(default)} "
            f"| {best['label'] if best else '-'} | {_cell(best, 'median_ms', '.3f')} "
            f"| {_x_torch_cell(best)} | {_cell(best, 'x_default', '.3f')} "
            f"| {_config_brief(best['config'], base) if best else '-'} |"
        )
    lines += [
        "",
        "## Every run",
        "",
        "| product | shape | run | median ms | TFLOP/s | x torch | x torch unpaired "
        "| x default | status | config (changes from the default) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for pair in results["pairs"]:
        torch_rec = pair["torch"] or {"status": "not run"}
        lines.append(
            f"| {pair['product']} | {pair['shape']} | torch._grouped_mm "
            f"| {_cell(torch_rec, 'median_ms', '.3f')} | {_cell(torch_rec, 'tflops', '.1f')} "
            f"| - | - | - | {_status(torch_rec)} | - |"
        )
        default = _default_run(pair)
        base = default["config"] if default else None
        for rec in pair["runs"]:
            brief = _config_brief(rec["config"], None if rec is default else base)
            lines.append(
                f"| {pair['product']} | {pair['shape']} | {rec['label']} "
                f"| {_cell(rec, 'median_ms', '.3f')} | {_cell(rec, 'tflops', '.1f')} "
                f"| {_x_torch_cell(rec)} | {_cell(rec, 'x_torch_unpaired', '.3f')} "
                f"| {_cell(rec, 'x_default', '.3f')} "
                f"| {_status(rec)} | {brief} |"
            )
    lines += ["", "## Why each candidate", ""]
    seen = set()
    for pair in results["pairs"]:
        for rec in pair["runs"]:
            key = (pair["product"], rec["label"])
            if key not in seen:
                seen.add(key)
                lines.append(f"- {pair['product']} `{rec['label']}`: {rec['why']}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True, help="folder for sweep.{json,md}")
    ap.add_argument(
        "--budget-s", type=float, default=200.0, help="start no run after this many seconds"
    )
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shape, interpret mode")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--products", default=",".join(PRODUCTS))
    ap.add_argument(
        "--max-candidates", type=int, default=8, help="candidates a pair besides the default"
    )
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--timed", type=int, default=None, help="timed samples (>= 10 on the GPU)")
    ap.add_argument("--repeats", type=int, default=2, help="runs compared bitwise")
    ap.add_argument("--sample-s", type=float, default=None, help="least time of one sample")
    ap.add_argument("--subset-rows", type=int, default=256)
    ap.add_argument(
        "--paired",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time each run of ours in alternation with torch and take x torch from the "
        "per-pair ratios (default: on; ~0.1 s more a run, see bench/README.md)",
    )
    argv = list(argv) if argv is not None else None
    args = ap.parse_args(argv)
    import sys

    args.argv = list(argv) if argv is not None else sys.argv[1:]
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    names = [s for s in args.shapes.split(",") if s]
    unknown = set(names) - {s.name for s in shapes}
    if unknown:
        ap.error(f"unknown shapes {sorted(unknown)}; known: {[s.name for s in shapes]}")
    args.shape_list = [s for s in shapes if not names or s.name in names]
    args.products = [p for p in args.products.split(",") if p]
    if set(args.products) - set(PRODUCTS):
        ap.error(f"unknown products {sorted(set(args.products) - set(PRODUCTS))}; {PRODUCTS}")
    args.warmup = (0 if args.smoke else 3) if args.warmup is None else args.warmup
    args.timed = (2 if args.smoke else 10) if args.timed is None else args.timed
    args.sample_s = (0.0 if args.smoke else 0.005) if args.sample_s is None else args.sample_s
    if args.repeats < 1 or args.timed < 1 or args.warmup < 0 or args.max_candidates < 0:
        ap.error("--repeats and --timed must be >= 1, --warmup and --max-candidates >= 0")
    # What bench.grouped_gemm_h200.run_candidate and Bench read from its own arguments.
    args.time_failed = False
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch_mod = gg._import_torch(args)
    sweep = Sweep(args, torch_mod)
    print(json.dumps(sweep.results["environment"], indent=1), flush=True)
    results = sweep.run()
    print(f"wrote {args.out}/sweep.{{json,md}} after {sweep.clock.elapsed():.0f} s", flush=True)
    return results


if __name__ == "__main__":
    main()
