#!/usr/bin/env bash
# The grouped-GEMM benchmark's one device call (issue 4). From the repository root, as a device
# run with the tokamax wheels carried (carry: [".whl"], timeout_s 600):
#   bash bench/grouped_gemm_h200.sh
# Extra arguments go to bench/grouped_gemm_h200.py (e.g. --families torch,tokamax,xla).
# Installs the carried wheels (tokamax and the small pure-Python packages the image lacks),
# runs the benchmark writing its results and log to $OUT (or ./bench-out; rewritten after every
# product, so a run cut short still returns its numbers), then copies them to bench/results/.
set -uo pipefail
out="${OUT:-bench-out}"
mkdir -p "$out" bench/results
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site"
else
  echo "no .whl/: tokamax will be reported as not available" >&2
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi -L
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
    --format=csv
} 2>&1 | tee "$out/device.txt"
python3 -m bench.grouped_gemm_h200 --out "$out" "$@" 2>&1 | tee "$out/grouped_gemm_h200.log"
rc=${PIPESTATUS[0]}
cp "$out/grouped_gemm_h200.json" "$out/grouped_gemm_h200.md" bench/results/ 2>/dev/null
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv 2>&1 >>"$out/device.txt"
exit "$rc"
