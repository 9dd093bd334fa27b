"""XLA's GEMMs under the compile options that decide how they run: a dense projection's two
backward products (dx = c @ w^T, dw = x^T @ c; the forward product is unused and dropped) at the
`gpu` training preset's shapes, bf16 operands, f32 loss.

    python -m bench.gemm_options --out DIR

Variants: `triton_untuned` (autotuner off, XLA's Triton GEMM fusions: their default tiling),
`cublas_untuned` (autotuner off, Triton GEMMs off: cuBLAS by its heuristics, as
`mok_jax.compiler_options()`), `autotuned` (XLA's defaults). Each untuned variant runs in two
fresh processes, whose gradients are compared by a checksum of their bits. Time: bench.harness's
median of 10 samples of back-to-back calls between two syncs; TFLOP/s counts 4 * M * K * N (two
products). Writes DIR/gemm_options.json and prints one line per variant and shape.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness as h

VARIANTS = {
    "triton_untuned": {"xla_gpu_autotune_level": 0},
    "cublas_untuned": {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False},
    "autotuned": {},
}
# [M, K] x [K, N]: the attention's qkv and output projections over 64 x 1024 tokens, and the
# shared expert's gate (or up) projection over a token chunk of 16,384.
SHAPES = {"qkv": (65536, 1024, 3072), "o": (65536, 1024, 1024), "shared_up": (16384, 1024, 512)}


def measure(variant: str, shape: str) -> dict:
    """Time and checksum of the two backward products of `shape` under `variant`."""
    m, k, n = SHAPES[shape]
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.03).astype(jnp.bfloat16)
    c = jax.random.normal(kc, (m, n), jnp.bfloat16)

    def loss(x, w):
        return jnp.sum((x @ w).astype(jnp.float32) * c.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)), compiler_options=VARIANTS[variant])
    out = jax.block_until_ready(grads(x, w))
    checksum = [int(np.asarray(a).view(np.uint16).astype(np.uint64).sum()) for a in out]
    runner = h.Runner(lambda: grads(x, w), jax.block_until_ready, h.as_tuple)
    ms = h.time_runner(runner, warmup=3, timed=10, target_sample_s=0.005)["median_ms"]
    return {"ms": ms, "tflops": 4 * m * k * n / ms / 1e9, "checksum": checksum}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # one process's share
    args = ap.parse_args()
    if args.variant:
        print(json.dumps({s: measure(args.variant, s) for s in SHAPES}))
        return
    results = {"environment": h.environment("gemm_options")}
    for variant in VARIANTS:
        runs = []
        for _ in range(1 if variant == "autotuned" else 2):
            cmd = [sys.executable, "-m", "bench.gemm_options", "--out", str(args.out)]
            done = subprocess.run([*cmd, "--variant", variant], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{variant}: {done.stderr[-2000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        for shape in SHAPES:
            row = {key: runs[0][shape][key] for key in ("ms", "tflops")}
            row["same_bits_two_processes"] = (
                runs[0][shape]["checksum"] == runs[1][shape]["checksum"] if len(runs) > 1 else None
            )
            results[f"{variant}/{shape}"] = row
            print(variant, shape, row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm_options.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
