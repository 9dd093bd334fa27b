"""Quickstart: build a layer from a preset, run it forward and backward, and report.

    python -m mok_jax                         # tiny preset, 512 tokens, checked against reference
    python -m mok_jax --preset deepseek_v3    # scaled down to CPU size, same routing
    python -m mok_jax --preset mixtral_8x7b --full-size --tokens 4096 --no-reference   # on a GPU

It prints the shapes, the auxiliary losses, the expert load, the time of the forward and of the
forward + backward (compile and steady state), whether two runs gave the same bits, and the error
of every output and gradient against the `reference` implementation.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from mok_jax.config import IMPLEMENTATIONS, PRESETS, MoEConfig, scale_down
from mok_jax.determinism import compiler_options
from mok_jax.layer import moe
from mok_jax.options import MoEOptions
from mok_jax.params import MoEParams, init_params
from mok_jax.resolve import resolve
from mok_jax.routing import MoEAux
from mok_jax.tolerances import relative_error, tolerance


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mok_jax", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument(
        "--full-size",
        action="store_true",
        help="keep the preset's real sizes (default: scale down all but 'tiny')",
    )
    parser.add_argument("--tokens", type=int, default=512, help="tokens T (default 512)")
    parser.add_argument(
        "--implementation",
        default="auto",
        choices=("auto", *IMPLEMENTATIONS),
        help="default auto: fused on a Hopper GPU where it supports the config, else xla",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="compute dtype, e.g. bfloat16 or float32 (default: the preset's)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=10, help="timed runs (median reported)")
    parser.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the comparison with the reference (E times the FLOPs)",
    )
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        parser.error(f"--tokens={args.tokens} and --repeats={args.repeats} must be >= 1")
    try:
        _config(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def _scaled(args: argparse.Namespace) -> bool:
    return not args.full_size and args.preset != "tiny"


def _config(args: argparse.Namespace) -> MoEConfig:
    cfg = PRESETS[args.preset]
    if _scaled(args):
        cfg = scale_down(cfg)
    changes = {"implementation": args.implementation}
    if args.dtype is not None:
        changes["dtype"] = args.dtype
    return dataclasses.replace(cfg, **changes)


def _timed(fn: Callable, *args, repeats: int) -> tuple[object, float, float]:
    """(result, seconds of the first call (compile + run), median seconds of `repeats` more)."""
    start = time.perf_counter()
    result = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return result, first, statistics.median(times)


def _loss_fn(cfg: MoEConfig, cotangent: jax.Array) -> Callable:
    def loss(x, params):
        y, aux = moe(x, params, cfg)
        return jnp.vdot(y.astype(jnp.float32), cotangent) + aux.loss, (y, aux)

    return jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True),
        compiler_options=compiler_options(),
    )


def _print_load(aux: MoEAux, cfg: MoEConfig, num_tokens: int) -> None:
    load = [int(n) for n in aux.tokens_per_expert]
    mean = num_tokens * cfg.top_k / cfg.num_experts
    print(
        f"expert load   : {sum(load)} rows over {cfg.num_experts} experts; min {min(load)}, "
        f"mean {mean:.1f}, max {max(load)} (max/mean {max(load) / mean:.2f}); "
        f"{load.count(0)} idle; dropped {int(aux.dropped)}"
    )
    if cfg.num_experts <= 32:
        width = 40 / max(max(load), 1)
        for e, n in enumerate(load):
            print(f"  expert {e:3d} {n:6d} {'#' * round(n * width)}")


def _print_errors(grads, grads_ref, y, y_ref, cfg: MoEConfig) -> bool:
    tol = tolerance(cfg.dtype)
    fields = [f.name for f in dataclasses.fields(MoEParams)]
    names = ["y", "dL/dx"] + [f"dL/d{name}" for name in fields]
    got = [y, grads[0], *(getattr(grads[1], name) for name in fields)]
    want = [y_ref, grads_ref[0], *(getattr(grads_ref[1], name) for name in fields)]
    ok = True
    print(f"vs reference  : max |a - b| / max |b| (bound for {cfg.dtype.name}: {tol.atol:.1e})")
    for name, a, b in zip(names, got, want, strict=True):
        if a is None:
            continue
        err = relative_error(a, b)
        ok &= err <= tol.atol
        print(f"  {name:18s} {err:.2e} {'ok' if err <= tol.atol else 'TOO LARGE'}")
    return ok


def _rate(flops: float, seconds: float) -> str:
    rate = flops / seconds
    return f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.2f} GFLOP/s"


def _print_header(args: argparse.Namespace, cfg: MoEConfig, params: MoEParams) -> None:
    device = jax.devices()[0]
    print(
        f"mok-jax quickstart on {device.platform.upper()} ({device.device_kind}), "
        f"jax {jax.__version__}"
    )
    print(
        f"config        : {args.preset}{' (scaled down)' if _scaled(args) else ''}: "
        f"D={cfg.d_model} F={cfg.d_ff} E={cfg.num_experts} K={cfg.top_k} "
        f"S={cfg.num_shared_experts} {cfg.score_fn} groups={cfg.num_groups}/{cfg.topk_groups} "
        f"capacity={cfg.capacity_factor} dtype={cfg.dtype.name}"
    )
    resolution = resolve(cfg, num_tokens=args.tokens)
    print(f"runs          : {resolution.summary()}")
    for line in resolution.report().splitlines():
        print(f"                {line}")
    total = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    active = (
        cfg.d_model * cfg.num_experts
        + (cfg.top_k + cfg.num_shared_experts) * 3 * cfg.d_model * cfg.d_ff
    )
    print(f"parameters    : {total:,} in all, {active:,} active per token")


def _run(args: argparse.Namespace, cfg: MoEConfig) -> bool:
    key_p, key_x, key_c = jax.random.split(jax.random.key(args.seed), 3)
    params = init_params(key_p, cfg)
    _print_header(args, cfg, params)
    x = jax.random.normal(key_x, (args.tokens, cfg.d_model), jnp.float32).astype(cfg.dtype)
    cotangent = jax.random.normal(key_c, x.shape, jnp.float32)
    # FLOPs of the expert GEMMs (3 per SwiGLU) of the forward; the backward does twice as many.
    flops = 2 * args.tokens * (cfg.top_k + cfg.num_shared_experts) * 3 * cfg.d_model * cfg.d_ff

    forward = jax.jit(moe, static_argnames="cfg", compiler_options=compiler_options())
    (y, aux), first, median = _timed(lambda: forward(x, params, cfg=cfg), repeats=args.repeats)
    print(f"shapes        : x {x.shape} {x.dtype} -> y {y.shape} {y.dtype}")
    print(f"aux losses    : aux_loss {float(aux.aux_loss):.6f}, z_loss {float(aux.z_loss):.6f}")
    _print_load(aux, cfg, args.tokens)
    print(
        f"time forward  : {median * 1e3:.2f} ms median of {args.repeats} (first call with "
        f"compile {first:.2f} s), {_rate(flops, median)} of expert GEMMs"
    )

    step = _loss_fn(cfg, cotangent)
    ((_, _), grads), first, median = _timed(step, x, params, repeats=args.repeats)
    print(
        f"time fwd+bwd  : {median * 1e3:.2f} ms median of {args.repeats} (first call with "
        f"compile {first:.2f} s), {_rate(3 * flops, median)} of expert GEMMs"
    )
    again = step(x, params)[1]
    same = all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(again), strict=True)
    )
    print(
        f"deterministic : {'yes' if same else 'NO'}: a second forward+backward gave "
        f"{'the same' if same else 'different'} bits"
    )
    if args.no_reference or cfg.implementation == "reference":
        return same
    ref_cfg = dataclasses.replace(cfg, implementation="reference", options=MoEOptions())
    (_, (y_ref, _)), grads_ref = _loss_fn(ref_cfg, cotangent)(x, params)
    return _print_errors(grads, grads_ref, y, y_ref, cfg) and same


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the quickstart; returns 0 when every check passed, 1 when one failed, 2 when the
    device ran out of memory."""
    args = _parse(argv)
    cfg = _config(args)
    try:
        return 0 if _run(args, cfg) else 1
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(
            f"out of device memory at --tokens {args.tokens}: {str(e).splitlines()[0][:200]}\n"
            "The xla implementation's backward goes through jax.lax.ragged_dot, whose transpose "
            "XLA expands to every expert on every row on GPU. Try fewer --tokens; --no-reference "
            "also skips the reference's E-fold work.",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
