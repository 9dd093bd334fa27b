#!/usr/bin/env bash
# Nsight Compute around bench/gmm_profile.py on the GPU machine (issue 4): the counters of our
# forward grouped GEMM (one launch per config label) and of torch._grouped_mm at one shape.
#   bash bench/gmm_profile.sh [SHAPE] [LABELS]     e.g. mixtral_gate_up default,cluster2
# Writes $OUT/ncu_SHAPE.csv (ncu's details page, one row per metric of each profiled launch),
# $OUT/ncu_SHAPE.ncu-rep and $OUT/ncu_SHAPE.log. --clock-control none: the device's own clocks
# (the device README asks to leave them alone; the SM frequency under load is one of the
# readings).
set -uo pipefail
shape="${1:-mixtral_gate_up}"
labels="${2:-default,cluster2}"
out="${OUT:-bench-out}"
mkdir -p "$out"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
ncu --profile-from-start off --clock-control none --target-processes all \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats \
  --export "$out/ncu_$shape" --force-overwrite \
  python3 -m bench.gmm_profile --shape "$shape" --labels "$labels" 2>&1 | tee "$out/ncu_$shape.log"
rc=${PIPESTATUS[0]}
ncu --import "$out/ncu_$shape.ncu-rep" --csv --page details >"$out/ncu_$shape.csv" 2>&1
exit "$rc"
