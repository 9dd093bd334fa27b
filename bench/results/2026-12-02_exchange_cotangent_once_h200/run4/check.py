"""A GPU check of the layer on a 1-device mesh in several rounds (per_gemm)
against no mesh, after the backward began sending the cotangent once (e6f2cb3)."""

import dataclasses
import time

import jax

from mok_jax import make_mesh, presets
from tests.mok_jax.cases import assert_same_rows, random_inputs
from tests.mok_jax.test_expert_parallel import value_and_grads

t0 = time.time()
cfg = dataclasses.replace(presets["qwen3_30b_a3b"], implementation="fused", buffer_factor=0.3)
x, params, cotangent = random_inputs(cfg, 2048, 0)
base = value_and_grads(x, params, cotangent, cfg, None)
print(f"no mesh done {time.time() - t0:.1f} s", flush=True)
mesh = make_mesh("expert", devices=jax.devices()[:1])
run_cfg = dataclasses.replace(cfg, exchange_on_one_device=True)
result = value_and_grads(x, params, cotangent, run_cfg, mesh)
print(f"mesh done {time.time() - t0:.1f} s, rounds {int(result[0][1][1].rounds)}", flush=True)
assert int(result[0][1][1].rounds) >= 2
assert_same_rows(result, base, cfg.dtype)
print(f"PASSED: y and dx bitwise, gradients within bf16 tolerance, {time.time() - t0:.1f} s")
