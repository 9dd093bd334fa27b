#!/usr/bin/env bash
# The exchange's device calls on one H200 (issue 7), from the repository root, in five calls
# (sessions 19 and 20's times; each call's limits, with timeout's 15 s grace, stay within 600 s):
#   STEPS=1 bash bench/exchange_h200.sh            # timeout_s 600: the layer tests (344 s)
#   STEPS=3 bash bench/exchange_h200.sh            # timeout_s 600: the one-kernel forward's
#                                                  #   twins (145 s)
#   STEPS=2 bash bench/exchange_h200.sh            # timeout_s 600: the dispatch twins (~250 s,
#                                                  #   estimated: a 210 s cut plus 35 s)
#   STEPS=4 bash bench/exchange_h200.sh            # timeout_s 600: the layer's times (325 s)
#   STEPS=5 bash bench/exchange_h200.sh            # timeout_s 600: where the time goes
# Each step runs under its own timeout (a hung kernel costs its step, not the call), its log in
# $OUT:
#   1. the layer's GPU test on a 1-device mesh (tests/mok_jax/test_fused_mesh.py);
#   2. the dispatch kernels' GPU twins (send_rows, dispatch_swiglu, dispatch_down_grad: the
#      kernels the zeroed tail changed; the return kernels run in step 1's layer test);
#   3. the one-kernel forward's GPU twins (dispatch_mlp_return);
#   4. the layer probe, per exchange fusion (bench/exchange_probe.py --only layer; FUSIONS,
#      default "per_gemm,forward"; PARAM_DTYPE, default float32: bfloat16 is where the mesh's
#      backward used to round-trip the weight gradients through f32, mended in session 19);
#   5. the kernels' profile of fused without a mesh and on a 1-device mesh, forward and
#      forward+backward (bench/layer_profile.py, qwen3 at 16384 tokens; PROFILE_IMPLEMENTATIONS
#      and PROFILE_PRODUCTS, default "fused,fused_mesh1" and "forward,fwd_bwd", narrow it:
#      fused_mesh1's fwd_bwd alone took about 130 s in session 20).
# A failed step does not stop the next. Each pytest test gets at most TEST_TIMEOUT (310) s. The
# limits are above sessions 19 and 20's times: the layer tests 344 s for both fusions (213 s for
# the one test of session 19), the four one-kernel forward twins 145 s, and the 4-stage
# dispatch_down_grad twin alone 35 s; session 19's first call, with limits from session 16's
# times, cut all three.
set -uo pipefail
out="${OUT:-bench-out}"
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
steps="${STEPS:-1}"
test_timeout="${TEST_TIMEOUT:-310}"
{
  date -u
  git rev-parse HEAD 2>/dev/null || true
  nvidia-smi -L
} >"$out/device.txt" 2>&1

gpu_tests() {  # name, timeout (s), pytest arguments...
  local name="$1" limit="$2"
  shift 2
  timeout -k 15 "$limit" python3 -m pytest -m gpu -v -p no:cacheprovider \
    -o timeout="$((test_timeout < limit - 10 ? test_timeout : limit - 10))" "$@" \
    >"$out/$name.log" 2>&1
  echo "$name: exit $? ($(tail -n 1 "$out/$name.log"))"
}

for step in $steps; do
  case "$step" in
    1) gpu_tests fused_mesh_tests "${MESH_TIMEOUT:-420}" tests/mok_jax/test_fused_mesh.py ;;
    2) gpu_tests exchange_tests "${TWIN_TIMEOUT:-400}" tests/pallas_kernels/exchange \
         -k "place_every_row or dispatch_swiglu or down_grad" ;;
    3) gpu_tests forward_kernel_tests "${FORWARD_TIMEOUT:-240}" tests/pallas_kernels/exchange \
         -k "dispatch_mlp_return" ;;
    4) timeout -k 15 "${PROBE_TIMEOUT:-540}" python3 -m bench.exchange_probe \
         --out "$out/layer.json" --timeout "$((${PROBE_TIMEOUT:-540} - 10))" --only layer \
         --tiles 64 --programs 24 \
         --fusions "${FUSIONS:-per_gemm,forward}" --param-dtype "${PARAM_DTYPE:-float32}" \
         >"$out/layer.log" 2>&1
       echo "layer probe: exit $? ($(tail -n 1 "$out/layer.log"))" ;;
    5) timeout -k 15 "${PROFILE_TIMEOUT:-540}" python3 -m bench.layer_profile \
         --out "$out/profile" --no-command-buffers --shapes qwen3 \
         --implementations "${PROFILE_IMPLEMENTATIONS:-fused,fused_mesh1}" \
         --products "${PROFILE_PRODUCTS:-forward,fwd_bwd}" --iters 3 \
         >"$out/profile.log" 2>&1
       echo "layer profile: exit $? ($(tail -n 1 "$out/profile.log"))" ;;
    *) echo "unknown step $step (1 to 5)" >&2 ;;
  esac
done
