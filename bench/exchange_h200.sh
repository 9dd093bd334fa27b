#!/usr/bin/env bash
# The exchange's device call on one H200 (issue 7), from the repository root:
#   bash bench/exchange_h200.sh             # timeout_s 600
# Checks, then times, each step under its own timeout, everything under $OUT:
#   1. the layer's GPU tests on a 1-device mesh (tests/mok_jax/test_fused_mesh.py);
#   2. the exchange kernels' GPU twins: the forward in one kernel (dispatch_mlp_return), the
#      dispatch (send_rows), the overlapped kernels of the forward and of the backward;
#   3. the layer probe, per exchange fusion (bench/exchange_probe.py --only layer).
# A failed step does not stop the next: each step's log says what it got. STEPS picks steps
# (default "1 2 3"); FUSIONS the probe's fusions (default "per_gemm,forward").
set -uo pipefail
out="${OUT:-bench-out}"
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
steps="${STEPS:-1 2 3}"
{
  date -u
  git rev-parse HEAD 2>/dev/null || true
  nvidia-smi -L
} >"$out/device.txt" 2>&1

gpu_tests() {  # name, timeout (s), pytest arguments...
  local name="$1" limit="$2"
  shift 2
  timeout "$limit" python3 -m pytest -m gpu -v -p no:cacheprovider -o timeout="$((limit - 10))" \
    "$@" >"$out/$name.log" 2>&1
  echo "$name: exit $? ($(tail -n 1 "$out/$name.log"))"
}

for step in $steps; do
  case "$step" in
    1) gpu_tests fused_mesh_tests "${MESH_TIMEOUT:-220}" tests/mok_jax/test_fused_mesh.py ;;
    2) gpu_tests exchange_tests "${TWIN_TIMEOUT:-150}" tests/pallas_kernels/exchange \
         -k "dispatch_mlp_return or place_every_row or dispatch_swiglu or down_grad" ;;
    3) timeout "${PROBE_TIMEOUT:-200}" python3 -m bench.exchange_probe --out "$out/layer.json" \
         --timeout "$((${PROBE_TIMEOUT:-200} - 10))" --only layer --tiles 64 --programs 24 \
         --fusions "${FUSIONS:-per_gemm,forward}" >"$out/layer.log" 2>&1
       echo "layer probe: exit $? ($(tail -n 1 "$out/layer.log"))" ;;
    *) echo "unknown step $step (1, 2 or 3)" >&2 ;;
  esac
done
