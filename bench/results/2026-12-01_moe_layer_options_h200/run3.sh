#!/usr/bin/env bash
# Run 3: candidate 1 (mok_jax xla) against fused (defaults), both products.
set -u
OUT="$OUT/bench" bash bench/moe_layer_h200.sh --shapes qwen3_30b_a3b,dsv3_slice,mixtral_8x7b \
  --candidates fused,xla --budget-s 500 --hard-limit-s 540
cd "$OUT" && tar -czf bench.tgz bench && rm -rf bench
