"""Does the `gpu` preset's train step at LAYERS blocks run on this GPU?

    python scan_probe.py LAYERS scan|unrolled default|nodsf|nounroll [REMAT]

Builds and compiles the step as `bench/scan_cost.py` does (its `_build`: the blocks under
`lax.scan`, or the scan unrolled), with `mok_jax.compiler_options()` plus the named XLA
options, then runs 2 steps and times 3. Prints OK with the ms a step and the first loss, or
the traceback and FAIL.
"""

import dataclasses
import sys
import traceback

import mok_jax
from bench import scan_cost
from train import data as data_lib
from train.config import PRESETS

EXTRA = {
    "default": {},
    "nodsf": {"xla_gpu_enable_dynamic_slice_fusion": False},
    "nounroll": {"xla_gpu_enable_while_loop_unrolling": "WHILE_LOOP_UNROLLING_NO_UNROLL"},
}


def use_options(opts: str) -> None:
    """`mok_jax.compiler_options()` from now on returns its options plus EXTRA[opts]."""
    base = mok_jax.compiler_options
    mok_jax.compiler_options = lambda: {**base(), **EXTRA[opts]}


def main() -> None:
    layers, variant, opts = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    use_options(opts)
    preset = PRESETS["gpu"]
    model_cfg = dataclasses.replace(preset.model, n_layers=layers)
    train_cfg = preset.train
    if len(sys.argv) > 4:
        train_cfg = dataclasses.replace(train_cfg, remat=sys.argv[4])
    print("moe_every", model_cfg.moe_every, "groups", model_cfg.num_moe_layers, flush=True)
    try:
        trainer, seconds = scan_cost._build(model_cfg, train_cfg, variant)
        print(f"compiled {seconds:.1f} s remat {trainer.remat}", flush=True)
        tokens = data_lib.load_bytes("synthetic")
        arrays = data_lib.batch_at(
            tokens, 0, batch_size=train_cfg.batch_size, seq_len=train_cfg.seq_len, seed=0
        )
        ms, loss = scan_cost._time_steps(trainer, arrays, 3)
        print(f"OK layers={layers} {variant} {opts} {ms:.2f} ms loss {loss:.6f}", flush=True)
    except Exception:
        traceback.print_exc()
        print(f"FAIL layers={layers} {variant} {opts}", flush=True)


if __name__ == "__main__":
    main()
