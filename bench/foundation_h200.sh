#!/usr/bin/env bash
# One device call for the foundation: the GPU-marked tests, the quickstart at real layer sizes,
# then the whole suite on the GPU backend. Writes logs to $OUT (or ./bench-out).
#   run on the device machine:  bash bench/foundation_h200.sh
set -uo pipefail
out="${OUT:-bench-out}"; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
{ date -u; nvidia-smi -L; python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'; } \
  2>&1 | tee "$out/device.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu tests 2>&1 | tee "$out/pytest_gpu_marked.log"
for args in "--preset qwen3_30b_a3b --full-size --tokens 16384" \
            "--preset mixtral_8x7b --full-size --tokens 8192" \
            "--preset qwen3_30b_a3b --full-size --tokens 4096" \
            "--preset tiny --tokens 4096"; do
  echo "== python3 -m mok_jax $args --no-reference"
  timeout 120 python3 -m mok_jax $args --no-reference 2>&1 | grep -v "^  expert "
done 2>&1 | tee "$out/quickstart.log"
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 0 -m "not gpu" tests 2>&1 | tail -40 \
  | tee "$out/pytest_suite_on_gpu.log"
