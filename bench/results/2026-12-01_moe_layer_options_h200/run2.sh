#!/usr/bin/env bash
# Run 2: the layer's kernel GPU tests and the gathered-rows GPU test, then the Zipf
# shape's forward+backward with the defaults, every candidate but xla.
set -u
t0=$(date +%s)
mkdir -p "$OUT/tests"
timeout 200 python3 -m pytest -m gpu -v -p no:cacheprovider -rA --durations=0 --timeout 150 \
  "tests/mok_jax/test_layer.py::test_gpu_kernels_real_size_match_reference" \
  tests/pallas_kernels/grouped_matmul/test_mosaic_gpu_gather.py \
  > "$OUT/tests/gpu_tests.log" 2>&1
echo "pytest rc $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/tests/gpu_tests.log"
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests/gpu_tests.log" | tail -8
left=$(( 565 - ($(date +%s) - t0) ))
OUT="$OUT/bench" bash bench/moe_layer_h200.sh --shapes qwen3_30b_a3b_zipf1.2 \
  --products fwd_bwd --candidates fused,pallas,torch,torch_det,tokamax \
  --budget-s $(( left - 25 )) --hard-limit-s $(( left - 5 ))
cd "$OUT" && tar -czf bench.tgz bench && tar -czf tests.tgz tests && rm -rf bench tests
