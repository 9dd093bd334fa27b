#!/usr/bin/env bash
# Run 4: the Zipf shape with both speed options (tokamax and torch_det paired), then
# each option alone at mixtral and dsv3 (torch paired), so their shares of the gain are apart.
set -u
run() {  # run NAME BUDGET ARGS...
  local name=$1 budget=$2; shift 2
  OUT="$OUT/$name" bash bench/moe_layer_h200.sh --products fwd_bwd --budget-s "$budget" \
    --hard-limit-s $(( budget + 15 )) "$@"
}
run zipf_options 150 --shapes qwen3_30b_a3b_zipf1.2 --candidates fused,tokamax,torch_det \
  --fused-options fused_residuals=gate_up,token_chunk=2048
run gate_up_only 165 --shapes mixtral_8x7b,dsv3_slice --candidates fused,torch \
  --fused-options fused_residuals=gate_up
run chunk_only 165 --shapes mixtral_8x7b,dsv3_slice --candidates fused,torch \
  --fused-options token_chunk=2048
cd "$OUT" && tar -czf bench.tgz zipf_options gate_up_only chunk_only && rm -rf zipf_options gate_up_only chunk_only
