"""Compile and step time of the expert-parallel layer's forward+backward on simulated CPU
devices, per exchange: what a rack's expert count costs the compiler, without a GPU.

    python -m bench.expert_parallel_cpu            # 8 and 72 devices, both exchanges

Each device count runs in its own process (XLA fixes the CPU device count at start-up). The
layer is a scaled-down mok_bench (D = F = 64, f32; 144 experts on 72 devices, 32 on 8) with 4
tokens per device; the step time is bench.harness's median of 5 samples. Prints a markdown
table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

LAYOUTS = {8: "expert", 72: "nvl72_ep72"}


def measure(num_devices: int) -> list[dict]:
    import dataclasses

    import jax
    import jax.numpy as jnp

    import mok_jax
    from bench import harness as h

    base = dataclasses.replace(mok_jax.presets["mok_bench"], dtype=jnp.float32)
    cfg = mok_jax.scale_down(base, max_experts=144 if num_devices == 72 else 32)
    mesh = mok_jax.make_mesh(LAYOUTS[num_devices])
    key_p, key_x = jax.random.split(jax.random.key(0))
    params = mok_jax.mesh.shard_params(mok_jax.init_params(key_p, cfg), mesh)
    x = mok_jax.mesh.shard_tokens(
        jax.random.normal(key_x, (4 * num_devices, cfg.d_model), jnp.float32), mesh
    )
    rows = []
    for exchange in mok_jax.EXCHANGES:
        c = dataclasses.replace(cfg, exchange=exchange)

        def loss(x, params, c=c):
            y, aux = mok_jax.moe(x, params, c, mesh=mesh)
            return jnp.sum(y * y) + aux.loss

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        start = time.perf_counter()
        compiled = step.lower(x, params).compile()
        compile_s = time.perf_counter() - start
        runner = h.Runner(lambda c=compiled: c(x, params), jax.block_until_ready, h.as_tuple)
        timing = h.time_runner(runner, warmup=1, timed=5, target_sample_s=0.0)
        rows.append(
            {
                "devices": num_devices,
                "mesh": dict(mesh.shape),
                "experts": cfg.num_experts,
                "tokens": 4 * num_devices,
                "exchange": exchange,
                "compile_s": round(compile_s, 2),
                "step_ms": round(timing["median_ms"], 1),
            }
        )
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(measure(int(sys.argv[2]))))
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for num_devices in LAYOUTS:
        env = dict(
            os.environ,
            PYTHONPATH=root,
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}",
        )
        out = subprocess.run(
            [sys.executable, "-m", "bench.expert_parallel_cpu", "--child", str(num_devices)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    print("| devices | mesh (data x expert) | experts | tokens | exchange | compile s | step ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        shape = f"{r['mesh']['data']} x {r['mesh']['expert']}"
        print(
            f"| {r['devices']} | {shape} | {r['experts']} | {r['tokens']} | {r['exchange']} "
            f"| {r['compile_s']} | {r['step_ms']} |"
        )


if __name__ == "__main__":
    main()
