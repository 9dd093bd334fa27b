#!/usr/bin/env bash
# Run 1: GPU tests of the kernels and the layer, then the layer benchmark's forward+backward
# with fused_residuals=gate_up,token_chunk=2048, every baseline paired (tokamax included).
set -u
t0=$(date +%s)
mkdir -p "$OUT/tests"
timeout 235 python3 -m pytest -m gpu -q -p no:cacheprovider -rA --timeout 150 \
  tests/pallas_kernels/grouped_matmul/test_ops.py \
  tests/pallas_kernels/grouped_matmul/test_mosaic_gpu_gather.py \
  tests/pallas_kernels/grouped_matmul/test_mosaic_gpu_wgrad.py \
  tests/mok_jax/test_layer.py tests/mok_jax/test_determinism.py \
  > "$OUT/tests/gpu_tests.log" 2>&1
echo "pytest rc $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/tests/gpu_tests.log"
tail -5 "$OUT/tests/gpu_tests.log"
left=$(( 560 - ($(date +%s) - t0) ))
OUT="$OUT/bench" bash bench/moe_layer_h200.sh --shapes dsv3_slice,mixtral_8x7b,qwen3_30b_a3b \
  --products fwd_bwd --candidates fused,tokamax,torch,torch_det \
  --fused-options fused_residuals=gate_up,token_chunk=2048 \
  --budget-s $(( left - 25 )) --hard-limit-s $(( left - 5 ))
cd "$OUT" && tar -czf bench.tgz bench && tar -czf tests.tgz tests && rm -rf bench tests
