"""The expert-parallel layer on one GPU (EP = 1): both exchanges lower, run and match.

On one device the exchange degenerates to copies to itself; this shows the GPU path (the
`ragged_all_to_all` custom call and the ring's ppermutes with a 1-device axis) compiles and
gives the bits of the unsharded layer, then times forward and forward+backward.

  PYTHONPATH=. python3 bench/expert_parallel_gpu.py --out results.json

Writes JSON with the device, date, command and every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import mok_jax
from mok_jax import compiler_options, make_mesh

CASES = {
    "tiny": (mok_jax.presets["tiny"], 4096),
    "qwen3_30b_a3b": (mok_jax.presets["qwen3_30b_a3b"], 4096),
}


def loss(x, params, cotangent, cfg, mesh):
    y, aux = mok_jax.moe(x, params, cfg, mesh=mesh)
    return jnp.sum(y.astype(jnp.float32) * cotangent) + aux.loss, (y, aux)


def timed(fn, *args, repeats: int = 5) -> tuple[float, float, object]:
    """(compile + first run s, median of `repeats` runs in ms, result)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return first, statistics.median(times), out


def run_case(name: str, cfg, num_tokens: int, exchange: str) -> dict:
    cfg = dataclasses.replace(cfg, exchange=exchange)
    key_p, key_x, key_c = jax.random.split(jax.random.key(0), 3)
    params = mok_jax.init_params(key_p, cfg)
    x = jax.random.normal(key_x, (num_tokens, cfg.d_model), jnp.bfloat16)
    cotangent = jax.random.normal(key_c, (num_tokens, cfg.d_model), jnp.float32)
    mesh = make_mesh("expert", devices=jax.devices()[:1])
    options = compiler_options()
    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    fwd = jax.jit(lambda *a: loss(*a, cfg, mesh), compiler_options=options)
    fwd_bwd = jax.jit(lambda *a: grad(*a, cfg, mesh), compiler_options=options)
    plain = jax.jit(lambda *a: grad(*a, cfg, None), compiler_options=options)
    args = (x, params, cotangent)
    compile_fwd, ms_fwd, _ = timed(fwd, *args)
    compile_bwd, ms_bwd, out = timed(fwd_bwd, *args)
    again = fwd_bwd(*args)
    unsharded = plain(*args)
    leaves = lambda t: jax.tree.leaves(t)  # noqa: E731
    repeat_bitwise = all(
        bool(jnp.array_equal(a, b)) for a, b in zip(leaves(out), leaves(again), strict=True)
    )
    (_, (y, aux)), (dx, _) = out
    (_, (y1, _)), (dx1, _) = unsharded
    text = fwd_bwd.lower(*args).as_text()
    return {
        "case": name,
        "exchange": exchange,
        "tokens": num_tokens,
        "config": {
            "d_model": cfg.d_model,
            "d_ff": cfg.d_ff,
            "experts": cfg.num_experts,
            "top_k": cfg.top_k,
            "dtype": cfg.dtype.name,
            "row_tile": cfg.row_tile,
        },
        "compile_fwd_s": round(compile_fwd, 2),
        "compile_fwd_bwd_s": round(compile_bwd, 2),
        "fwd_ms": round(ms_fwd, 3),
        "fwd_bwd_ms": round(ms_bwd, 3),
        "rounds": int(aux.rounds),
        "repeat_bitwise": repeat_bitwise,
        "y_equals_unsharded_bitwise": bool(jnp.array_equal(y, y1)),
        "dx_equals_unsharded_bitwise": bool(jnp.array_equal(dx, dx1)),
        "lowered_has_ragged_all_to_all": "ragged_all_to_all" in text,
        "lowered_has_collective_permute": "collective_permute" in text,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args(argv)
    results = {
        "command": "PYTHONPATH=. python3 bench/expert_parallel_gpu.py " + " ".join(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "runs": [],
    }
    for name in args.cases.split(","):
        cfg, num_tokens = CASES[name]
        for exchange in mok_jax.EXCHANGES:
            row = run_case(name, cfg, num_tokens, exchange)
            print(json.dumps(row), flush=True)
            results["runs"].append(row)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
