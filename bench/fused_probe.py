"""First measurements of the fused forward's pieces on the GPU (issue 5).

    PYTHONPATH=. python3 -m bench.fused_probe --out FILE [--shapes qwen3,mixtral,dsv3]
        [--layer qwen3] [--backward qwen3,mixtral,dsv3]

At issue 5's layer shapes (one GPU, all experts local, uniform random routing through the
layer's own plan), after checking the gathered kernel against the plain one bit for bit, times:
- `gather`: the permuted copy of the tokens the `pallas` implementation makes, x[rows] (XLA);
- `swiglu`: the gate/up kernel on that copy (`mosaic_gpu.gmm_swiglu`);
- `swiglu_gathered`: the same kernel reading its rows straight from x (`lhs_rows_m`, one 1-row
  TMA per row and K step), which replaces both;
with --backward, the expert MLP's backward on the plan's rows (checked equal first):
- `bwd_kernel`: `mosaic_gpu.gmm_swiglu_bwd`, gate, up and dy @ w_down.T in one kernel whose
  epilogue forms h, [d_gate | d_up] and d_s;
- `bwd_xla_epilogue`: the same outputs as the backward made them before it: three f32 gmm
  calls, then XLA's elementwise pass over the f32 [M, F] products;
- `bwd_all`: the whole backward, `ops.swiglu_mlp_grads` (by default recomputing as
  `bwd_xla_epilogue` does, then d_w_down, d_lhs with [w_gate | w_up] read in two parts, and
  [d_w_gate, d_w_up] stored as two arrays); `bwd_all_kernel` the same with the kernel
  (recompute="kernel");
- `bwd_all_before`: the whole backward as before, with the concatenated weights and sliced
  weight gradients;
- with --backward-configs, `bwd_kernel` with other tiles (`BACKWARD_CONFIGS`, checked against
  the default's h and [d_gate | d_up] bit for bit first), whose default is not yet measured;
and, with --layer, the whole layer (`mok_jax.moe`, forward, then forward+backward of
sum(y * cotangent)) with implementation `pallas` against `fused`. Each time is the median of
grouped_gemm_h200's samples (>= 5 ms of back-to-back calls each) after warm-up.

Writes FILE (one JSON record per measurement) and prints each.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import pathlib
import sys
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp

from bench import grouped_gemm_h200 as gg
from mok_jax import init_params, moe, presets
from mok_jax.plan import make_plan
from pallas_kernels.grouped_matmul import mosaic_gpu, ops, tuning
from pallas_kernels.grouped_matmul.mosaic_gpu_wgrad import tgmm

WARMUP, TIMED, TARGET_SAMPLE_S = 2, 10, 0.005

# (preset, tokens T) of issue 5's layer benchmark; E, k, D, F from the preset.
SHAPES = {
    "qwen3": ("qwen3_30b_a3b", 16384),
    "mixtral": ("mixtral_8x7b", 8192),
    "dsv3": ("deepseek_v3", 4096),
}
DSV3_EXPERTS = 32  # issue 5's deepseek-v3 slice


def _cfg(name: str):
    preset, tokens = SHAPES[name]
    cfg = presets[preset]
    if name == "dsv3":
        cfg = dataclasses.replace(cfg, num_experts=DSV3_EXPERTS)
    return cfg, tokens


def _time(fn, *args) -> dict:
    return gg.time_runner(
        gg.jax_runner(fn, *args), warmup=WARMUP, timed=TIMED, target_sample_s=TARGET_SAMPLE_S
    )


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _settings(settings: dict):
    """Sets mosaic_gpu's module settings (kernel-source variants) for the block."""
    saved = {key: getattr(mosaic_gpu, key) for key in settings}
    for key, value in settings.items():
        setattr(mosaic_gpu, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(mosaic_gpu, key, value)


def kernels(name: str, explore: bool = False) -> Iterator[dict]:
    """gather + swiglu against swiglu_gathered at one shape (with `explore`, also the variants
    of the gathered kernel's issue loop and the plain kernel under Lane semantics)."""
    cfg, tokens = _cfg(name)
    d, f, e, k = cfg.d_model, cfg.d_ff, cfg.num_experts, cfg.top_k
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (tokens, d), jnp.float32).astype(jnp.bfloat16)
    w_gate, w_up = (
        (jax.random.normal(key, (e, d, f), jnp.float32) / 32).astype(jnp.bfloat16)
        for key in keys[1:3]
    )
    experts = jax.random.randint(keys[3], (tokens, k), 0, e, jnp.int32)
    plan = make_plan(experts, e)
    rows = plan.order_n // k
    sizes = plan.group_sizes_e

    def gather(x, rows):
        return x[rows]

    def swiglu(x_rows):
        return mosaic_gpu.gmm_swiglu(x_rows, w_gate, w_up, sizes)

    def swiglu_gathered(x, rows):
        return mosaic_gpu.gmm_swiglu(x, w_gate, w_up, sizes, lhs_rows_m=rows)

    _progress(f"{name}: checking the gathered kernel against the plain one")
    x_rows = jax.jit(gather)(x, rows)
    plain = jax.jit(swiglu)(x_rows)
    same = bool(jnp.array_equal(plain, jax.jit(swiglu_gathered)(x, rows)))
    if not same:
        raise AssertionError(f"{name}: the gathered kernel's bits differ from the plain one's")
    flops = 2 * 2 * rows.shape[0] * d * f
    candidates = [
        ("gather", gather, (x, rows), {}),
        ("swiglu", swiglu, (x_rows,), {}),
        ("swiglu_gathered", swiglu_gathered, (x, rows), {}),
    ]
    if explore:
        # Kernel-source variants, each a module setting of mosaic_gpu traced under it.
        candidates += [
            (f"swiglu_gathered_unroll{u}", swiglu_gathered, (x, rows), {"_GATHER_UNROLL": u})
            for u in (4, 8)
        ]
        lane = {"_PLAIN_SEMANTICS": mosaic_gpu.plgpu.LoweringSemantics.Lane}
        candidates.append(("swiglu_lane_semantics", swiglu, (x_rows,), lane))
    for label, fn, args, settings in candidates:
        _progress(f"{name} {label}: compiling and timing")
        with _settings(settings):
            fn = jax.jit(lambda *a, fn=fn: fn(*a))
            if settings:
                same_here = bool(jnp.array_equal(fn(*args), plain))
                if not same_here:
                    raise AssertionError(f"{name} {label}: bits differ from the plain kernel's")
            timing = _time(fn, *args)
        record = {"shape": name, "what": label, "median_ms": timing["median_ms"], **timing}
        record["settings"] = {k: str(v) for k, v in settings.items()}
        if label != "gather":
            record["tflops"] = flops / (timing["median_ms"] * 1e-3) / 1e12
        record["bitwise_gathered_equals_plain"] = same
        yield record


def _xla_epilogue(x, dy, w_gate, w_up, w_down, sizes, scale):
    """gmm_swiglu_bwd's outputs as the backward made them before it: f32 gmm products, then
    XLA's elementwise pass."""
    gate, up = (mosaic_gpu.gmm(x, w, sizes, out_dtype=jnp.float32) for w in (w_gate, w_up))
    g = mosaic_gpu.gmm(dy, w_down, sizes, transpose_rhs=True, out_dtype=jnp.float32)
    h = (gate / (1.0 + jnp.exp(-gate)) * up).astype(x.dtype)
    dh = g * scale[:, None]
    sig = jax.nn.sigmoid(gate)
    d_gate = dh * up * (sig * (1.0 + gate * (1.0 - sig)))
    d_gate_up = jnp.concatenate([d_gate, dh * (gate * sig)], axis=1).astype(x.dtype)
    return h, d_gate_up, jnp.sum(h.astype(jnp.float32) * g, axis=1)


def _all_before(x, dy, w_gate, w_up, w_down, sizes, scale):
    """The whole backward as before gmm_swiglu_bwd, weight copies and slices included."""
    h, d_gate_up, d_s = _xla_epilogue(x, dy, w_gate, w_up, w_down, sizes, scale)
    dy_down = (dy.astype(jnp.float32) * scale[:, None]).astype(x.dtype)
    d_w_down = tgmm(h, dy_down, sizes, out_dtype=w_down.dtype)
    w_gate_up = jnp.concatenate([w_gate, w_up], axis=2)
    d_x = mosaic_gpu.gmm(d_gate_up, w_gate_up, sizes, transpose_rhs=True)
    d_w = tgmm(x, d_gate_up, sizes, out_dtype=w_gate.dtype)
    f = w_gate.shape[2]
    return d_x, d_w[:, :, :f], d_w[:, :, f:], d_w_down, d_s


# gmm_swiglu_bwd's tiles to try beside its default (128 x 64, consumers splitting rows, 3 stages):
# label -> TileConfig fields changed from the default. Three f32 accumulators a consumer.
# Measured and dropped: "n128_split_m" (block_n=128, 2 stages): 7.43 ms at qwen3 against the
# default's 3.73 (bench/results/2026-12-01_fused_probe_h200).
BACKWARD_CONFIGS = {
    "no_delay": dict(delay_release=0),
    "m64_one_consumer_4stages": dict(block_m=64, num_consumers=1, max_concurrent_steps=4),
    "n128_split_n": dict(block_n=128, consumer_dim="n", max_concurrent_steps=2),
}


def backward(name: str, configs: bool = False) -> Iterator[dict]:
    """The expert MLP's backward pieces, new against before (module docstring)."""
    cfg, tokens = _cfg(name)
    d, f, e, k = cfg.d_model, cfg.d_ff, cfg.num_experts, cfg.top_k
    keys = jax.random.split(jax.random.key(2), 7)
    rows = tokens * k
    x = jax.random.normal(keys[0], (rows, d), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[1], (rows, d), jnp.float32).astype(jnp.bfloat16)
    w_gate, w_up = (
        (jax.random.normal(key, (e, d, f), jnp.float32) / 32).astype(jnp.bfloat16)
        for key in keys[2:4]
    )
    w_down = (jax.random.normal(keys[4], (e, f, d), jnp.float32) / 32).astype(jnp.bfloat16)
    scale = jax.random.uniform(keys[5], (rows,), jnp.float32, 0.5, 1.5)
    experts = jax.random.randint(keys[6], (tokens, k), 0, e, jnp.int32)
    sizes = make_plan(experts, e).group_sizes_e
    args = (x, dy, w_gate, w_up, w_down, sizes, scale)

    def bwd_kernel(*a):
        return mosaic_gpu.gmm_swiglu_bwd(*a[:6], row_scale_m=a[6])

    def bwd_all(x, dy, w_gate, w_up, w_down, sizes, scale, recompute="gmm"):
        grads = ops.swiglu_mlp_grads(x, w_gate, w_up, w_down, sizes, scale, dy, recompute=recompute)
        return grads[:4] + grads[5:]

    bwd_all_kernel = functools.partial(bwd_all, recompute="kernel")

    _progress(f"{name}: checking the backward kernel against the XLA epilogue")
    new, before = jax.jit(bwd_kernel)(*args), jax.jit(_xla_epilogue)(*args)
    checks = {"h_bitwise": bool(jnp.array_equal(new[0], before[0]))}
    for label, a, b in (("d_gate_up", new[1], before[1]), ("d_s", new[2], before[2])):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        checks[f"{label}_rel_err"] = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    all_new, all_before = jax.jit(bwd_all)(*args), jax.jit(_all_before)(*args)
    for i, label in enumerate(("d_x", "d_w_gate", "d_w_up", "d_w_down", "d_s")):
        a, b = all_new[i].astype(jnp.float32), all_before[i].astype(jnp.float32)
        checks[f"all_{label}_rel_err"] = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    _progress(f"{name}: {checks}")
    if not checks["h_bitwise"] or max(v for key, v in checks.items() if key != "h_bitwise") > 0.02:
        raise AssertionError(f"{name}: the new backward differs from the one before: {checks}")
    passes = {
        "bwd_kernel": 3,
        "bwd_xla_epilogue": 3,
        "bwd_all": 8,
        "bwd_all_kernel": 8,
        "bwd_all_before": 8,
    }
    fns = {
        "bwd_kernel": bwd_kernel,
        "bwd_xla_epilogue": _xla_epilogue,
        "bwd_all": bwd_all,
        "bwd_all_kernel": bwd_all_kernel,
        "bwd_all_before": _all_before,
    }
    if configs:
        default = tuning.default_config("gmm_swiglu_bwd")
        for label, changes in BACKWARD_CONFIGS.items():
            config = dataclasses.replace(default, **changes)

            def variant(*a, config=config):
                return mosaic_gpu.gmm_swiglu_bwd(*a[:6], row_scale_m=a[6], config=config)

            try:
                outs = jax.jit(variant)(*args)
            except Exception as error:  # a config that does not build is a result too
                _progress(f"{name} bwd_kernel_{label}: {type(error).__name__}: {error}")
                yield {"shape": name, "what": f"bwd_kernel_{label}", "error": str(error)[:500]}
                continue
            same = all(bool(jnp.array_equal(a, b)) for a, b in zip(outs[:2], new[:2], strict=True))
            if not same:
                raise AssertionError(f"{name} {label}: h or d_gate_up bits differ from the default")
            fns[f"bwd_kernel_{label}"] = variant
            passes[f"bwd_kernel_{label}"] = 3
    for label, fn in fns.items():
        _progress(f"{name} {label}: compiling and timing")
        timing = _time(jax.jit(fn), *args)
        flops = passes[label] * 2 * rows * d * f
        yield {
            "shape": name,
            "what": label,
            "gemm_passes": passes[label],
            "tflops": flops / (timing["median_ms"] * 1e-3) / 1e12,
            **timing,
            **checks,
        }


def layer(name: str) -> list[dict]:
    """The layer, forward and forward+backward, `pallas` against `fused`."""
    cfg, tokens = _cfg(name)
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (tokens, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
    cotangent = jax.random.normal(keys[1], x.shape, jnp.float32).astype(jnp.bfloat16)
    out, results = [], {}
    for impl in ("pallas", "fused"):
        c = dataclasses.replace(cfg, implementation=impl)
        params = init_params(keys[2], c)

        def forward(x, params, c=c):
            return moe(x, params, c)[0]

        def loss(x, params, c=c):
            y, aux = moe(x, params, c)
            return jnp.sum(y.astype(jnp.float32) * cotangent) + aux.aux_loss

        def fwd_bwd(x, params, loss=loss):
            return jax.value_and_grad(loss, argnums=(0, 1))(x, params)

        results[impl] = jax.jit(forward)(x, params)
        for label, fn in (("forward", forward), ("fwd_bwd", fwd_bwd)):
            timing = _time(fn, x, params)
            out.append({"shape": name, "what": f"layer_{label}", "implementation": impl, **timing})
    same = bool(jnp.array_equal(results["pallas"], results["fused"]))
    for record in out:
        record["y_bitwise_fused_equals_pallas"] = same
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--shapes", default="qwen3,mixtral,dsv3", help=f"of {sorted(SHAPES)}")
    parser.add_argument("--layer", default="", help="shapes to time the whole layer at")
    parser.add_argument("--explore", action="store_true", help="also time kernel variants")
    parser.add_argument("--backward", default="", help="shapes to time the MLP backward at")
    parser.add_argument(
        "--backward-configs", action="store_true", help="also time gmm_swiglu_bwd's other tiles"
    )
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error("the probe times GPU kernels: no GPU backend here")
    header = {
        "command": "python3 -m bench.fused_probe " + " ".join(argv or []),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
    }
    records = []
    todo = [
        (functools.partial(kernels, explore=args.explore), s) for s in args.shapes.split(",") if s
    ]
    bwd = functools.partial(backward, configs=args.backward_configs)
    todo += [(bwd, s) for s in args.backward.split(",") if s]
    todo += [(layer, s) for s in args.layer.split(",") if s]
    for fn, shape in todo:
        for record in fn(shape):
            record = {**header, **record}
            record.pop("samples_ms", None)
            print(json.dumps(record), flush=True)
            records.append(record)
            args.out.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
