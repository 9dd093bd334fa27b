#!/usr/bin/env bash
# The grouped-GEMM benchmark's one device call (issue 4). From the repository root, as a device
# run with the tokamax wheels carried (carry: [".whl"], timeout_s 600):
#   bash bench/grouped_gemm_h200.sh
# Extra arguments go to bench/grouped_gemm_h200.py (e.g. --shapes qwen3_gate_up,qwen3_down).
# Installs the carried wheels (tokamax and the small pure-Python packages the image lacks) and
# runs the benchmark, writing its results and log to $OUT (or ./bench-out). The script plans the
# run to end 540 s after this wrapper started (--budget-s; the install and imports count), skips
# and records what does not fit, rewrites the results after every candidate, and its watchdog
# writes them and exits at 585 s if the run is still going (the device call's limit is 600 s).
# BENCH_MODULE runs another benchmark of the same shape the same way (bench/moe_layer_h200.sh).
set -uo pipefail
module="${BENCH_MODULE:-grouped_gemm_h200}"
started_at="$(date +%s.%N)"
out="${OUT:-bench-out}"
mkdir -p "$out"
if ! compgen -G ".whl/*.whl" >/dev/null; then
  echo "no .whl/: tokamax will be reported as not available" >&2
elif python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl; then
  export PYTHONPATH="/tmp/site"
else
  echo "installing .whl/ failed: tokamax will be reported as not available" >&2
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  date -u
  echo "wheels installed after $(python3 -c "import time; print(round(time.time() - $started_at, 1))") s"
  nvidia-smi -L
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
    --format=csv
} 2>&1 | tee "$out/device.txt"
python3 -m "bench.$module" --out "$out" --started-at "$started_at" "$@" 2>&1 \
  | tee "$out/$module.log"
rc=${PIPESTATUS[0]}
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv 2>&1 >>"$out/device.txt"
exit "$rc"
