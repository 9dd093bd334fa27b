"""Where the training step's time goes on the GPU: kernel time per part of the model.

    XLA_FLAGS=--xla_gpu_enable_command_buffer= python -m bench.train_profile --out DIR
        [--preset gpu] [--implementation fused] [--iters 3] [--batch-size N] [--top 25]

bench/README.md describes it. The parts are the named scopes in each kernel's op_name:
`optimizer`, `attention`, `dense_ffn`, the MoE layer's stages (`moe/route`, ...), and `other`
(embedding, head, loss, the scan's copies); the gap between the step's wall time and its
kernels' sum is the device idle (launches, host work). The XLA flag turns off command buffers,
whose kernels the profile would see as one unnamed event.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import re

import jax
import numpy as np

from bench import harness as h
from bench.harness.profile import module_name, traced_events
from bench.layer_profile import STAGES, op_of_instructions
from train import data as data_lib
from train.config import PRESETS
from train.step import Trainer

_MOE_STAGE = re.compile(r"\b(" + "|".join(STAGES) + r")\b")


def part_of(op_name: str) -> str:
    """The model part an HLO instruction's op_name names (the backward's read
    transpose(jvp(...)) around the same scopes)."""
    for scope in ("optimizer", "attention", "dense_ffn"):
        if re.search(rf"\b{scope}\b", op_name):
            return scope
    if re.search(r"\bmoe\b", op_name):
        stage = _MOE_STAGE.search(op_name)
        return f"moe/{stage.group(1) if stage else 'other'}"
    return "other"


def op_kind(op_name: str) -> str:
    """The operation an op_name ends in, e.g. "add" of ".../moe/add"; "(unnamed)" for none."""
    return op_name.rstrip("/").rsplit("/", 1)[-1] or "(unnamed)"


def profile(trainer: Trainer, iters: int, warmup: int = 3, top: int = 25) -> dict:
    """Kernel time per part of `iters` steps of `trainer`'s step (after `warmup` steps), the
    `top` kernels, and the `top` (part, operation) pairs (kernels grouped by the operation
    their op_name ends in: where a part's time goes)."""
    cfg = trainer.train_cfg
    args = trainer._abstract_args()
    with trainer.context():
        compiled = trainer._step.lower(*args).compile()
    hlo = compiled.as_text()
    module = module_name(hlo)
    ops = op_of_instructions(hlo, chars=400)
    tokens = data_lib.load_bytes("synthetic")
    state = trainer.init_state()
    x, y = (
        trainer.place_batch(a)
        for a in data_lib.batch_at(
            tokens, 0, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=0
        )
    )
    for _ in range(warmup):
        state, metrics = compiled(state, x, y)
    jax.block_until_ready(metrics)

    def step():
        nonlocal state
        state, metrics = compiled(state, x, y)
        jax.block_until_ready(metrics)

    events, wall_ms = traced_events(step, module, iters)
    by_part = collections.defaultdict(lambda: [0.0, 0])
    by_kernel = collections.defaultdict(lambda: [0.0, 0, ""])
    by_op = collections.defaultdict(lambda: [0.0, 0])
    for name, _, duration_ns in events:
        part = part_of(ops.get(name, ""))
        kind = by_op[part, op_kind(ops.get(name, ""))]
        kind[0] += duration_ns / 1e6 / iters
        kind[1] += 1 / iters
        by_part[part][0] += duration_ns / 1e6 / iters
        by_part[part][1] += 1 / iters
        kernel = by_kernel[name]
        kernel[0] += duration_ns / 1e6 / iters
        kernel[1] += 1 / iters
        kernel[2] = part
    top_ops = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "wall_ms_per_step": wall_ms,
        "kernel_ms_per_step": sum(v[0] for v in by_part.values()),
        "parts": {k: {"ms": v[0], "kernels": v[1]} for k, v in sorted(by_part.items())},
        "top": [
            {"kernel": k, "ms": v[0], "count": v[1], "part": v[2], "op": ops.get(k, "")[-160:]}
            for k, v in top
        ],
        "ops": [{"part": part, "op": op, "ms": v[0], "kernels": v[1]} for (part, op), v in top_ops],
    }


def render(result: dict) -> str:
    total = result["kernel_ms_per_step"] or 1.0
    parts = sorted(result["parts"].items(), key=lambda kv: -kv[1]["ms"])
    return "\n".join([
        f"step wall {result['wall_ms_per_step']:.1f} ms, kernels {total:.1f} ms", "",
        *h.table(["part", "ms / step", "share of kernels", "kernels / step"],
                 [[p, f"{v['ms']:.2f}", f"{v['ms'] / total:.1%}", f"{v['kernels']:.0f}"]
                  for p, v in parts]), "",
        *h.table(["top kernel", "part", "ms / step", "count", "op"],
                 [[k["kernel"], k["part"], f"{k['ms']:.2f}", f"{k['count']:.0f}",
                   k["op"].replace("|", "/")[-90:]] for k in result["top"]]), "",
        *h.table(["part", "operation", "ms / step", "kernels / step"],
                 [[k["part"], k["op"], f"{k['ms']:.2f}", f"{k['kernels']:.0f}"]
                  for k in result.get("ops", [])]),
    ])  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
    p.add_argument("--implementation", default=None)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--top", type=int, default=25, help="kernels and operations listed")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    changes = {"implementation": args.implementation, "batch_size": args.batch_size}
    train_cfg = dataclasses.replace(
        preset.train, **{k: v for k, v in changes.items() if v is not None}
    )
    trainer = Trainer(preset.model, train_cfg, None)
    result = profile(trainer, args.iters, top=args.top)
    result |= {
        "environment": h.environment("train_profile", argv),
        "device": jax.devices()[0].device_kind,
        "preset": args.preset,
        "implementation": train_cfg.implementation,
        "batch_size": train_cfg.batch_size,
        "remat": trainer.remat,
    }
    text = render(result)
    h.write_files(
        args.out,
        {
            "train_profile.json": json.dumps(result, indent=1) + "\n",
            "train_profile.md": text + "\n",
        },
    )
    print(text)
    print("kernels / step:", int(np.round(sum(v["kernels"] for v in result["parts"].values()))))


if __name__ == "__main__":
    main()
