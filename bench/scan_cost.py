"""What the scan over blocks costs: the training step with its blocks applied by `lax.scan`
(as `train.model.scan_groups` applies them) against the same blocks unrolled (each block its
own copy in the program), at a reduced depth.

    python -m bench.scan_cost --out DIR [--preset gpu] [--layers 2] [--steps 10] [--rounds 3]

Unrolled, the MoE layer's kernels and their backward are compiled once per block (at the
`gpu` preset's 12 blocks, minutes), so both variants run the preset with `--layers` blocks.
In one process, `rounds` rounds each build, compile (as the train loop does) and time `steps`
steps of one variant, then of the other, from the same initial state and batch, one variant's
program on the device at a time. Reported per variant: each round's compile seconds, the
median of the rounds' ms per step, and the first step's loss; then the scan's extra ms per
block ((scan - unrolled) / layers) and that cost as a share of a step of the preset's full
depth (`--full-step-ms`, the measured step of the preset, if given). Writes
DIR/scan_cost.json and prints a summary.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import pathlib
import statistics
import time
from unittest import mock

import jax

from bench import harness as h
from train import data as data_lib
from train import model as model_lib
from train.config import PRESETS
from train.step import Trainer

VARIANTS = ("scan", "unrolled")


def _variant(name: str):
    """A context in which the model applies its groups as `name` says."""
    if name == "scan":
        return contextlib.nullcontext()
    unrolled = functools.partial(model_lib.scan_groups, unroll=True)
    return mock.patch.object(model_lib, "scan_groups", unrolled)


def _build(model_cfg, train_cfg, name: str) -> tuple[Trainer, float]:
    """A Trainer whose step is variant `name`, compiled as the train loop compiles it
    (`Trainer.compile`), and the seconds that took."""
    started = time.perf_counter()
    with _variant(name):
        trainer = Trainer(model_cfg, train_cfg, None)
        trainer.compile()
    return trainer, time.perf_counter() - started


def _time_steps(trainer: Trainer, arrays, steps: int) -> tuple[float, float]:
    """(ms per step over `steps` steps from a fresh initial state, the first step's loss)."""
    batch = tuple(trainer.place_batch(a) for a in arrays)
    state = trainer.init_state()
    state, metrics = trainer.train_step(state, *batch)
    first_loss = float(metrics["loss"])
    state, metrics = trainer.train_step(state, *batch)
    jax.block_until_ready(metrics)
    started = time.perf_counter()
    for _ in range(steps):
        state, metrics = trainer.train_step(state, *batch)
    jax.block_until_ready(metrics)
    elapsed = time.perf_counter() - started
    del state, metrics
    return elapsed * 1e3 / steps, first_loss


def measure(model_cfg, train_cfg, steps: int, rounds: int) -> dict:
    """Alternating rounds of the two variants. Each round builds and compiles its variant's
    Trainer afresh (so neither reuses the other's traced program) and frees it, and JAX's
    caches, before the next: one step's program and state on the device at a time."""
    tokens = data_lib.load_bytes("synthetic")
    arrays = data_lib.batch_at(
        tokens, 0, batch_size=train_cfg.batch_size, seq_len=train_cfg.seq_len, seed=0
    )
    results = {name: {"compile_s": [], "round_ms": []} for name in VARIANTS}
    for round_index in range(rounds):
        for name in VARIANTS:
            print(f"round {round_index + 1} of {rounds}: {name}", flush=True)
            trainer, seconds = _build(model_cfg, train_cfg, name)
            ms, loss = _time_steps(trainer, arrays, steps)
            results[name]["compile_s"].append(seconds)
            results[name]["round_ms"].append(ms)
            results[name]["first_loss"] = loss
            results[name]["remat"] = trainer.remat
            del trainer
            gc.collect()
            jax.clear_caches()
    for result in results.values():
        result["step_ms"] = statistics.median(result["round_ms"])
    return results


def summarize(results: dict, layers: int, full_step_ms: float | None, full_layers: int) -> dict:
    """The scan's extra ms per block, and its share of a full-depth step where one is given."""
    extra_ms = (results["scan"]["step_ms"] - results["unrolled"]["step_ms"]) / layers
    summary = {
        "scan_over_unrolled": results["scan"]["step_ms"] / results["unrolled"]["step_ms"],
        "scan_extra_ms_per_block": extra_ms,
        "same_first_loss": results["scan"]["first_loss"] == results["unrolled"]["first_loss"],
    }
    if full_step_ms:
        summary["share_of_full_step"] = extra_ms * full_layers / full_step_ms
    return summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=2, help="blocks of the reduced model")
    p.add_argument("--batch-size", type=int, help="the preset's by default")
    p.add_argument("--steps", type=int, default=10, help="timed steps a round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--full-step-ms", type=float, help="the preset's measured step, full depth")
    args = p.parse_args(argv)
    if args.layers < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--layers, --steps and --rounds must be at least 1")
    preset = PRESETS[args.preset]
    model_cfg = dataclasses.replace(preset.model, n_layers=args.layers)
    train_cfg = preset.train
    if args.batch_size:
        train_cfg = dataclasses.replace(train_cfg, batch_size=args.batch_size)
    results = measure(model_cfg, train_cfg, args.steps, args.rounds)
    summary = summarize(results, args.layers, args.full_step_ms, preset.model.n_layers)
    record = {
        "environment": h.environment("scan_cost", argv),
        "preset": args.preset,
        "layers": args.layers,
        "batch_size": train_cfg.batch_size,
        "implementation": train_cfg.implementation,
        "results": results,
        "summary": summary,
    }
    h.write_files(args.out, {"scan_cost.json": json.dumps(record, indent=1) + "\n"})
    for name, result in results.items():
        rounds = ", ".join(f"{ms:.2f}" for ms in result["round_ms"])
        print(
            f"{name}: compile {result['compile_s'][0]:.1f} s, step {result['step_ms']:.2f} ms "
            f"(rounds {rounds}), first loss {result['first_loss']:.6f}"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
