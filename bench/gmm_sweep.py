"""Tile-config sweep of our grouped GEMMs, each config against torch._grouped_mm.

    python -m bench.gmm_sweep --out DIR [--budget-s S] [--shapes ...] [--products ...]
    python -m bench.gmm_sweep --smoke --out DIR     # CPU: one tiny shape, interpret mode

bench/README.md describes the pairs, passes and tables. Every run goes through
bench/grouped_gemm.py's `run_candidate` (its check, bitwise repeats and paired timing); a paired
run's x torch is the median of the per-pair ratios torch_i / ours_i. Writes DIR/sweep.json and
DIR/sweep.md, rewritten after every run; `python -m bench.grouped_gemm --configs
DIR/sweep.json` then times our kernels with each pair's best config.
"""

from __future__ import annotations

import os

# torch shares the GPU with JAX in this process (set before jax starts).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.80")

import argparse
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from bench import grouped_gemm as gg
from bench import harness as h
from pallas_kernels.grouped_matmul import mosaic_gpu, mosaic_gpu_wgrad, tuning
from pallas_kernels.grouped_matmul.tuning import TileConfig

NAME = "sweep"
PRODUCTS = ("forward", "wgrad", "dgrad", "swiglu")  # the order within a pass
SHAPES = tuple(s for s in gg.SHAPES if s.routing == "uniform")  # DESIGN.md's five
SMOKE_SHAPES = tuple(s for s in gg.SMOKE_SHAPES if s.routing == "uniform")
DEFAULT_LABEL = "default"


@dataclasses.dataclass(frozen=True)
class Trial:
    """One candidate config of one (product, shape) pair."""

    label: str
    config: TileConfig
    why: str


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


# Our kernels: (product) -> the function and its arguments. Tests swap this table.


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


@dataclasses.dataclass
class Pair:
    product: str
    shape: gg.Shape
    trials: list[Trial]
    record: dict  # what goes into sweep.json
    full: tuple | None = None  # all-elements reference (torch's checked output, or XLA's)
    subsets: tuple | None = None
    torch_runner: h.Runner | None = None  # torch, checked and timed: --paired times with it


class Sweep:
    def __init__(self, args, torch):
        self.args, self.torch = args, torch
        self.budget = h.Budget(args.budget_s)
        self.interpret = args.smoke and jax.default_backend() != "gpu"
        self.problems: dict[str, gg.Problem] = {}
        self.pairs: list[Pair] = []
        for product in args.products:
            for shape in args.shape_list:
                if product == "swiglu" and not shape.gate_up:
                    continue
                trials = candidates(product, shape, smoke=args.smoke)[: args.max_candidates + 1]
                record = {
                    "product": product, "shape": shape.name,
                    "mknG": [shape.m, shape.k, shape.n, shape.g], "kernel": KERNEL_NAMES[product],
                    "flops": gg.product_cost(shape, product)[0], "torch": None, "runs": [],
                }  # fmt: skip
                self.pairs.append(Pair(product, shape, trials, record))
        self.results: dict[str, Any] = {
            "environment": h.environment("gmm_sweep", args.argv),
            "method": (
                "bench/grouped_gemm.py's run_candidate for every run: checked against torch (all "
                "elements; without torch: XLA ragged_dot / reference.tgmm on a CPU, none on a "
                "GPU) and reference.py f32 on the first/middle/last/largest groups, |err| <= "
                f"2^-6 (|ref| + rms ref); {args.repeats} runs compared bitwise; {args.warmup} "
                f"warm-up + 1 calibration call, then the median of {args.timed} samples of >= "
                f"{args.sample_s * 1e3:.0f} ms; TFLOP/s = 2*M*K*N / median; uniform routing, seed 0"
                + (
                    "; --paired: x torch = the median of the per-pair ratios torch_i / ours_i "
                    "[25th-75th percentile], x default = a run's x torch over the default's, the "
                    "best run = the highest x torch"
                    if args.paired
                    else ""
                )
                + ("; SMOKE RUN: no number means anything" if args.smoke else "")
            ),
            "args": {k: v for k, v in vars(args).items() if k != "shape_list"},
            "pairs": [pair.record for pair in self.pairs],
        }

    def run(self) -> dict:
        depth = max((len(pair.trials) for pair in self.pairs), default=0)
        for index in range(depth):
            for pair in self.pairs:
                if index == 0:
                    self._run_torch(pair)
                if index < len(pair.trials):
                    self._run_trial(pair, pair.trials[index])
        self.save()
        return self.results

    def _prepare(self, pair: Pair, rec: dict) -> gg.Problem | None:
        """The pair's inputs and reference subsets; None (the reason in `rec`) if they cannot be
        made: the sweep goes on with the other pairs."""
        try:
            if pair.shape.name not in self.problems:
                self.problems[pair.shape.name] = gg.make_problem(pair.shape, self.torch)
            p = self.problems[pair.shape.name]
            if pair.subsets is None:
                pair.subsets = gg.subset_reference(p, pair.product, cap=self.args.subset_rows)
        except Exception as e:  # e.g. out of memory: recorded, not fatal
            rec["status"] = f"error preparing the pair: {type(e).__name__}: {e}"[:1500]
            return None
        return p

    def _run(self, pair: Pair, rec: dict, cand: gg.Candidate, full, paired_with=None):
        p = self._prepare(pair, rec)
        if p is None:
            return None, ()
        result, runner, outs = gg.run_candidate(
            cand, pair.product, full=full, subsets=pair.subsets, sizes=p.sizes, args=self.args,
            budget=self.budget, paired_with=paired_with,
        )  # fmt: skip
        rec.update({k: v for k, v in result.items() if k not in ("name", "family", "extra")})
        self._summarize(pair, rec)
        return runner, outs

    def _run_torch(self, pair: Pair) -> None:
        rec = pair.record["torch"] = {}
        if self.budget.skip_reason() is None and (p := self._prepare(pair, rec)) is not None:
            (cand,) = gg.Bench(self.args, p).torch_candidates(pair.product)
            runner, outs = self._run(pair, rec, cand, None)
            if rec.get("check", {}).get("ok"):
                pair.full = outs
                pair.record["full_reference"] = "torch (this pair's checked output)"
                if self.args.paired and "timing" in rec:
                    pair.torch_runner = runner
        rec.setdefault("status", self.budget.skip_reason())
        self.save()

    def _run_trial(self, pair: Pair, trial: Trial) -> None:
        rec = {"label": trial.label, "why": trial.why, "config": dataclasses.asdict(trial.config)}
        pair.record["runs"].append(rec)
        refused = fits(pair.product, pair.shape, trial.config)
        if (skipped := self.budget.skip_reason()) is not None:
            rec["status"] = skipped
        elif refused is not None:
            rec["status"] = f"not run: {refused}"
        elif (p := self._prepare(pair, rec)) is not None:
            if pair.full is None and jax.default_backend() != "gpu":
                # No torch: XLA's result on a CPU (tiny shapes); on a GPU, reference.tgmm in
                # f32 over every group is too slow: the reference.py subsets alone check then.
                pair.full = gg.full_reference(p, pair.product)
                pair.record["full_reference"] = "xla ragged_dot / reference.tgmm in f32 (no torch)"

            def build():
                fn, operands = KERNELS[pair.product](p, trial.config, self.interpret)
                return h.jax_runner(fn, *operands)

            cand = gg.Candidate(f"ours {trial.label}", "ours", build)
            self._run(pair, rec, cand, pair.full, pair.torch_runner)
        self.save()

    def _summarize(self, pair: Pair, rec: dict) -> None:
        """Flat fields of a run: ok, median_ms, tflops, x_torch, x_default; a paired run's
        x_torch is the paired one (x_torch_unpaired the ratio of the medians, x_default the
        ratio of the two runs' paired x torch: each against torch timed beside it)."""
        rec["ok"] = bool(rec.get("check", {}).get("ok")) and "timing" in rec
        if "timing" in rec:
            ms = rec["median_ms"] = rec["timing"]["median_ms"]
            rec["tflops"] = pair.record["flops"] / (ms * 1e-3) / 1e12
            if torch_ms := (pair.record.get("torch") or {}).get("median_ms"):
                rec["x_torch"] = torch_ms / ms
            if "x_torch_paired" in rec:
                rec["x_torch_unpaired"] = rec.get("x_torch")
                rec["x_torch"] = rec["x_torch_paired"]
                rec["x_torch_p25_p75"] = rec["x_torch_paired_p25_p75"]
            default = _default_run(pair.record)
            if default is not None and "median_ms" in default and rec is not default:
                if "x_torch_paired" in rec and "x_torch_paired" in default:
                    rec["x_default"] = rec["x_torch_paired"] / default["x_torch_paired"]
                else:
                    rec["x_default"] = default["median_ms"] / ms
        best = gg.best_run(pair.record)
        keys = ("label", "config", "median_ms", "tflops", "x_torch", "x_torch_p25_p75",
                "x_torch_unpaired", "x_default")  # fmt: skip
        pair.record["best"] = best and {k: best[k] for k in keys if k in best}
        where = f"{pair.product:8s} {pair.shape.name:16s} {rec.get('label', 'torch'):20s}"
        if "median_ms" in rec:
            ratios = "".join(f" {rec[k]:.3f}{k[2:]}" for k in ("x_torch", "x_default") if k in rec)
            print(
                f"  {where} {rec['median_ms']:8.3f} ms{ratios} [{'ok' if rec['ok'] else 'FAILED'}]"
            )
        else:
            print(f"  {where} {str(rec.get('status'))[:200]}", flush=True)

    def save(self) -> None:
        self.results["elapsed_s"] = round(self.budget.elapsed(), 1)
        h.save(self.args.out, NAME, self.results, render_markdown(self.results))


def _default_run(pair_record: dict) -> dict | None:
    return next((r for r in pair_record["runs"] if r["label"] == DEFAULT_LABEL), None)


def _cell(rec: dict | None, key: str, fmt: str) -> str:
    return "-" if not rec or rec.get(key) is None else format(rec[key], fmt)


def _x_torch_cell(rec: dict | None) -> str:
    """x torch; a paired one with its 25th-75th percentile."""
    if not rec or rec.get("x_torch") is None:
        return "-"
    if "x_torch_p25_p75" not in rec:
        return f"{rec['x_torch']:.3f}"
    lo, hi = rec["x_torch_p25_p75"]
    return f"{rec['x_torch']:.3f} [{lo:.3f}-{hi:.3f}]"


def _config_brief(config: dict, base: dict | None) -> str:
    changed = config if base is None else {k: v for k, v in config.items() if base.get(k) != v}
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
        f"- command: `{env['command']}`; date (UTC): {env['date']}; {h.versions_line(env)}",
        f"- method: {results['method']}",
        f"- elapsed: {results.get('elapsed_s', '-')} s",
        "",
        "## Best passing config per (product, shape)",
        "",
        "x torch: paired where it shows a [25th-75th percentile] (the median of torch_i / ours_i "
        "over samples timed in alternation), else torch's median over ours, timed apart.",
        "",
    ]
    best_rows, every_rows, why = [], [], {}
    for pair in results["pairs"]:
        where = [pair["product"], pair["shape"]]
        default, best = _default_run(pair), gg.best_run(pair)
        base = default["config"] if default else None
        best_rows.append([
            *where, _cell(pair["torch"], "median_ms", ".3f"), _cell(default, "median_ms", ".3f"),
            _x_torch_cell(default), best["label"] if best else "-", _cell(best, "median_ms", ".3f"),
            _x_torch_cell(best), _cell(best, "x_default", ".3f"),
            _config_brief(best["config"], base) if best else "-",
        ])  # fmt: skip
        torch_rec = pair["torch"] or {"status": "not run"}
        every_rows.append([*where, "torch._grouped_mm", _cell(torch_rec, "median_ms", ".3f"),
                           _cell(torch_rec, "tflops", ".1f"), "-", "-", "-", _status(torch_rec),
                           "-"])  # fmt: skip
        for rec in pair["runs"]:
            every_rows.append([
                *where, rec["label"], _cell(rec, "median_ms", ".3f"), _cell(rec, "tflops", ".1f"),
                _x_torch_cell(rec), _cell(rec, "x_torch_unpaired", ".3f"),
                _cell(rec, "x_default", ".3f"), _status(rec),
                _config_brief(rec["config"], None if rec is default else base),
            ])  # fmt: skip
            why.setdefault((pair["product"], rec["label"]), rec["why"])
    lines += h.table(
        ["product", "shape", "torch ms", "default ms", "default x torch", "best", "best ms",
         "best x torch", "best x default", "best config (changes from the default)"], best_rows,
    )  # fmt: skip
    lines += ["", "## Every run", ""]
    lines += h.table(
        ["product", "shape", "run", "median ms", "TFLOP/s", "x torch", "x torch unpaired",
         "x default", "status", "config (changes from the default)"], every_rows,
    )  # fmt: skip
    lines += ["", "## Why each candidate", ""]
    lines += [f"- {product} `{label}`: {text}" for (product, label), text in why.items()]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.add_run_args(ap)
    ap.add_argument("--products", default=",".join(PRODUCTS))
    ap.add_argument("--max-candidates", type=int, default=8, help="candidates besides the default")
    ap.add_argument("--subset-rows", type=int, default=256)
    args = ap.parse_args(argv)
    h.check_run_args(ap, args, SMOKE_SHAPES if args.smoke else SHAPES)
    args.products = h.pick(ap, args.products, PRODUCTS, "product")
    if args.max_candidates < 0:
        ap.error(f"--max-candidates must be >= 0, got {args.max_candidates}")
    args.argv = list(argv) if argv is not None else None
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch, args.torch_missing = h.import_torch()
    sweep = Sweep(args, torch)
    results = sweep.run()
    print(f"wrote {args.out}/{NAME}.{{json,md}} after {sweep.budget.elapsed():.0f} s", flush=True)
    return results


if __name__ == "__main__":
    main()
