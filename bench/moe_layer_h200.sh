#!/usr/bin/env bash
# The MoE layer benchmark's one device call (issue 5). From the repository root, as a device run
# with the tokamax wheels carried (carry: [".whl"], timeout_s 600):
#   bash bench/moe_layer_h200.sh
# Extra arguments go to bench/moe_layer_h200.py (e.g. --shapes mixtral_8x7b --candidates xla).
# The steps of bench/grouped_gemm_h200.sh (install the carried wheels, record the device, run the
# benchmark into $OUT with the budget counted from the wrapper's start), for this module.
BENCH_MODULE=moe_layer_h200 exec bash "$(dirname "$0")/grouped_gemm_h200.sh" "$@"
