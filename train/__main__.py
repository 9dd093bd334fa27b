"""`python -m train`: train the MoE language model; `python -m train sample`: generate from it.

    python -m train                                  # tiny preset, 8 simulated CPU devices, EP 8
    python -m train --steps 100 --workdir /tmp/run   # then: --steps 300 --resume continues it
    python -m train --steps 300 --workdir /tmp/run --resume-from 100   # from a chosen step
    python -m train --preset small --data ~/texts    # a text file or folder of your own
    python -m train --check-determinism --steps 5    # the same steps twice: bitwise equal?
    python -m train sample --workdir runs/tiny --prompt "def " --max-new-bytes 200

Multi-process (JAX's own runtime; each process runs the same command):
    python -m train --num-processes 2 --process-id 0 --coordinator localhost:12345 --devices 4
    python -m train --distributed    # jax.distributed.initialize() from the environment (SLURM..)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# jax reads XLA_FLAGS when its first backend starts, not when it is imported: importing the
# configs (and jax with them) before the device count is set is fine; using a device is not.
from mok_jax.config import IMPLEMENTATIONS
from train.compile_cache import ENV_VAR as CACHE_ENV_VAR
from train.config import MESH_LAYOUTS, PRESETS, REMAT_CHOICES

DEFAULT_CPU_DEVICES = 8


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _train_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m train",
        description=(
            "Train the byte-level MoE language model (mok_jax.MoE feed-forward blocks). "
            "Subcommand: 'python -m train sample --help'."
        ),
        epilog=_presets_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="model + run (default tiny; with --resume, the resumed run's saved settings)",
    )
    p.add_argument("--steps", type=int, help="train up to this step (default: the preset's)")
    p.add_argument(
        "--schedule-steps",
        type=int,
        help="the learning-rate schedule's length (default: the preset's; not --steps, so an "
        "interrupted run resumes on the same schedule)",
    )
    p.add_argument("--warmup-steps", type=int, help="(default: the preset's)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    p.add_argument("--batch-size", type=int, help="global batch (default: the preset's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    p.add_argument(
        "--data",
        help="'stdlib' (this Python's standard library sources), 'synthetic', or a path to a "
        "text file or folder (default: stdlib)",
    )
    p.add_argument("--workdir", help="output folder (default: runs/<preset>)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint that passes verification (a damaged newer "
        "one is reported and moved to WORKDIR/checkpoints_set_aside)",
    )
    p.add_argument(
        "--resume-from",
        type=int,
        metavar="STEP",
        help="continue from checkpoint STEP (as --resume; the steps after it are moved to "
        "WORKDIR/checkpoints_set_aside)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="delete a previous run in --workdir first"
    )
    p.add_argument(
        "--devices",
        type=int,
        help=f"devices to use; on CPU, the simulated devices per process (default: "
        f"{DEFAULT_CPU_DEVICES} on CPU, all on GPU)",
    )
    p.add_argument(
        "--layout",
        choices=MESH_LAYOUTS,
        help="mesh layout: expert (1 x devices, EP = devices; the default, or with --resume "
        "the resumed run's) or data_expert",
    )
    p.add_argument(
        "--data-parallel",
        type=int,
        help="the data-parallel degree of --layout data_expert (EP = devices / this)",
    )
    p.add_argument(
        "--implementation",
        choices=("auto", *IMPLEMENTATIONS),
        help="MoE implementation (default auto: fused on a Hopper GPU where it can, else xla; "
        "the run prints what it chose and why)",
    )
    p.add_argument("--seed", type=int, help="initialization and batch-order seed")
    p.add_argument("--eval-every", type=int, help="evaluate every N steps (0: off)")
    p.add_argument("--save-every", type=int, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--router-bias-rate", type=float, help="aux-loss-free balancing rate (0: off)")
    p.add_argument(
        "--remat",
        choices=REMAT_CHOICES,
        help="what the backward recomputes: none, attention (each block's attention), block "
        "(whole blocks), or auto (the default: the least recomputation whose memory estimate "
        "fits the device)",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        help="microbatches per step: the same batch's gradients in that many passes, for "
        "1/N of the activation memory (default 1)",
    )
    p.add_argument(
        "--cache-dir",
        help=f"JAX's persistent compilation cache folder (default: ${CACHE_ENV_VAR}, "
        "else ~/.cache/mok_jax), so a second run of the same step starts without compiling",
    )
    p.add_argument(
        "--no-compile-cache", action="store_true", help="turn the persistent compilation cache off"
    )
    p.add_argument(
        "--check-determinism",
        action="store_true",
        help="run --steps steps twice from fresh states and report bitwise equality",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-sample", action="store_true", help="skip the samples at the end")
    mp = p.add_argument_group("multi-process (jax.distributed)")
    mp.add_argument("--coordinator", help="host:port of process 0's coordinator")
    mp.add_argument("--num-processes", type=int, help="processes in the job")
    mp.add_argument("--process-id", type=int, help="this process's index")
    mp.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() with its auto-detection (SLURM, ...)",
    )
    return p


def _presets_text() -> str:
    """The presets' main values, for --help."""
    lines = ["presets:"]
    for name, preset in PRESETS.items():
        m, t = preset.model, preset.train
        lines.append(
            f"  {name}: {m.n_layers} blocks, D {m.d_model}, {m.moe.num_experts} experts top-"
            f"{m.moe.top_k}, MoE every {m.moe_every} block(s), {m.dtype.name}; {t.steps} steps "
            f"(schedule {t.schedule_steps}, warmup {t.warmup_steps}) of {t.batch_size} x "
            f"{t.seq_len} bytes, lr {t.peak_lr:g}, eval every {t.eval_every}, save every "
            f"{t.save_every}, router bias rate {t.router_bias_rate:g}"
        )
    return "\n".join(lines)


def _sample_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m train sample",
        description="Generate bytes from a run's newest checkpoint that passes verification "
        "(on one device); a damaged newer one is reported and skipped.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workdir", required=True, help="the training run's folder")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    p.add_argument("--max-new-bytes", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--step", type=int, help="sample from this checkpoint step (default: the newest good one)"
    )
    return p


def _set_devices(count: int | None, parser: argparse.ArgumentParser) -> None:
    """Asks XLA for `count` host devices (default 8), keeping the other XLA_FLAGS."""
    if count is not None and count < 1:
        parser.error(f"--devices={count} must be >= 1")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        if count is None:
            return
        flags = " ".join(
            f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")
        )
    wanted = DEFAULT_CPU_DEVICES if count is None else count
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={wanted}".strip()


def _distributed(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    explicit = (args.coordinator, args.num_processes, args.process_id)
    if not args.distributed and all(v is None for v in explicit):
        return
    if not args.distributed and any(v is None for v in explicit):
        parser.error("--coordinator, --num-processes and --process-id go together")
    import jax

    # Collectives between the processes' CPU devices (GPUs use NCCL whatever this says).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.distributed:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )


def _configs(args: argparse.Namespace):
    """The model and train configs of the preset with the flags' changes. `--devices` counts
    one process's devices: the run uses that many times the number of processes.

    With --resume (or --resume-from) and no --preset, the base is the settings the resumed run
    saved in its config.json (so `--steps m --resume` continues the same run: schedule, seed,
    data and batch included), and only the flags given change them."""
    import dataclasses
    import pathlib

    from train.checkpoint import CONFIG_FILE, read_run_configs

    preset = PRESETS[args.preset or "tiny"]
    model_base, train_base = preset.model, preset.train
    workdir = pathlib.Path(args.workdir or preset.train.workdir)
    resume = args.resume or args.resume_from is not None
    if resume and args.preset is None and (workdir / CONFIG_FILE).is_file():
        model_base, train_base = read_run_configs(workdir)
    processes = args.num_processes or 1
    if args.distributed:  # the count comes from jax.distributed's auto-detection
        import jax

        processes = jax.process_count()
    changes = {
        "steps": args.steps,
        "schedule_steps": args.schedule_steps,
        "warmup_steps": args.warmup_steps,
        "peak_lr": args.lr,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "data": args.data,
        "workdir": args.workdir,
        "devices": None if args.devices is None else args.devices * processes,
        "implementation": args.implementation,
        "seed": args.seed,
        "eval_every": args.eval_every,
        "save_every": args.save_every,
        "router_bias_rate": args.router_bias_rate,
        "layout": args.layout,
        "data_parallel": args.data_parallel,
        "remat": args.remat,
        "grad_accum": args.grad_accum,
    }
    changes = {k: v for k, v in changes.items() if v is not None}
    train_cfg = dataclasses.replace(train_base, **changes)
    model_cfg = model_base
    if train_cfg.seq_len > model_cfg.max_seq_len:
        model_cfg = dataclasses.replace(model_cfg, max_seq_len=train_cfg.seq_len)
    return model_cfg, train_cfg


def _cache_off(args: argparse.Namespace) -> bool:
    """--no-compile-cache, or several processes on CPUs: their gloo collectives give up when one
    process reaches the first step 30 s after another, which a cache hit on one side can make
    happen."""
    if args.no_compile_cache:
        return True
    import jax

    return jax.process_count() > 1 and jax.default_backend() == "cpu"


def main_train(argv: Sequence[str]) -> int:
    parser = _train_parser()
    args = parser.parse_args(argv)
    _set_devices(args.devices, parser)
    # A training process owns its GPU: let JAX's allocator take 90% of it (JAX's default is
    # 75%), unless the environment says otherwise.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    if args.resume_from is not None and args.overwrite:
        parser.error(f"--resume-from {args.resume_from} and --overwrite exclude each other")
    try:
        _distributed(args, parser)
        model_cfg, train_cfg = _configs(args)
    except ValueError as e:
        parser.error(str(e))

    from train import compile_cache, loop
    from train import data as data_lib
    from train.memory import DoesNotFit

    try:
        compile_cache.enable(None if _cache_off(args) else (args.cache_dir or ""))
    except OSError as e:
        parser.error(f"--cache-dir: {e}")
    try:
        if args.check_determinism:
            report = loop.check_determinism(model_cfg, train_cfg)
            verdict = "bitwise equal" if report.equal else "NOT bitwise equal"
            print(
                f"check-determinism: {report.steps} steps twice: losses "
                f"{'equal' if report.losses_equal else 'differ'}, final params "
                f"{'equal' if report.params_equal else 'differ'}: {verdict}"
            )
            if report.first_difference is not None:
                print(f"first differing loss at step {report.first_difference}")
            print(f"losses: {report.losses[0]}")
            return 0 if report.equal else 1
        summary = loop.train(
            model_cfg,
            train_cfg,
            resume=args.resume,
            resume_from=args.resume_from,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            sample=not args.no_sample,
        )
    except (data_lib.DataError, loop.WorkdirInUse, DoesNotFit, ValueError) as e:
        parser.error(str(e))
    except loop.TrainingDiverged as e:
        print(f"python -m train: {e}", file=sys.stderr)
        return 3
    import jax

    if jax.process_index() == 0:
        print(_done_line(summary))
        print(loop.summary_json(summary))
    return 0


def _done_line(summary) -> str:
    """The run's closing line (`summary`: a `train.loop.Summary`)."""
    if not summary.losses:
        return (
            f"done: nothing to train, the run is at step {summary.steps} already; outputs in "
            f"{summary.workdir}"
        )
    rate = f"{summary.tokens_per_s:,.0f} tokens/s" if summary.tokens_per_s else "n/a tokens/s"
    if summary.mfu is not None:
        rate += f" (MFU {summary.mfu:.1%})"
    if summary.peak_memory_bytes is not None:
        rate += f", peak memory {summary.peak_memory_bytes / 2**30:.1f} GiB"
    eval_text = f"{summary.final_eval_loss:.4f}" if summary.final_eval_loss is not None else "n/a"
    return (
        f"done: steps {summary.start_step} -> {summary.steps}, loss {summary.losses[0]:.4f} -> "
        f"{summary.final_loss:.4f}, eval loss {eval_text}, {rate}, "
        f"{summary.time_s:.1f} s; outputs in {summary.workdir}"
    )


def main_sample(argv: Sequence[str]) -> int:
    parser = _sample_parser()
    args = parser.parse_args(argv)
    if args.max_new_bytes < 1:
        parser.error(f"--max-new-bytes={args.max_new_bytes} must be >= 1")
    if not args.temperature >= 0:
        parser.error(f"--temperature={args.temperature} must be >= 0")
    _set_devices(1, parser)
    import pathlib

    from mok_jax import MoEOptions
    from train.checkpoint import CheckpointDamaged, Checkpoints, read_run_configs
    from train.sample import format_samples, generate
    from train.step import Trainer

    workdir = pathlib.Path(args.workdir)
    prompts = [p.encode() for p in (args.prompt or ["\n"])]
    try:
        model_cfg, train_cfg = read_run_configs(workdir)
        import dataclasses

        # Sampling runs `xla` on one device: the kernels' options do not apply there.
        moe = model_cfg.moe
        moe = dataclasses.replace(moe, options=MoEOptions(token_chunk=moe.options.token_chunk))
        model_cfg = dataclasses.replace(model_cfg, moe=moe)
        trainer = Trainer(model_cfg, dataclasses.replace(train_cfg, implementation="xla"), None)
        checkpoints = Checkpoints(workdir, read_only=True)
        try:
            restored = checkpoints.restore_newest_good(trainer, step=args.step)
        finally:
            checkpoints.close()
        continuations = generate(
            trainer.model(restored.state),
            prompts,
            max_new_bytes=args.max_new_bytes,
            temperature=args.temperature,
            seed=args.seed,
        )
    except CheckpointDamaged as e:
        parser.error(f"--step {args.step}: {e} (its folder: {e.folder})")
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e) if args.step is None else f"--step {args.step}: {e}")
    for damaged in restored.skipped:
        print(f"{damaged}; skipped, not deleted (rm -r {damaged.folder} removes it)")
    newest = ", the newest good checkpoint" if restored.skipped else ""
    print(f"step {restored.step} of {workdir}{newest}")
    print(format_samples(prompts, continuations, args.temperature))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sample":
        return main_sample(argv[1:])
    return main_train(argv)


if __name__ == "__main__":
    sys.exit(main())
