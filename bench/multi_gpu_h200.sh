#!/usr/bin/env bash
# The multi-GPU device call (issue 8), from the repository root on an nvidia-h200-x2 (or x4, x8):
#   bash bench/multi_gpu_h200.sh            # timeout_s 600
# Records the topology, runs bench/multi_gpu.py (correctness, bandwidth, weak scaling) into $OUT,
# then the PyTorch + NCCL baseline (bench/torch_ep.py), then the GPU tests that need several
# GPUs. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
set -uo pipefail
out="${OUT:-bench-out}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{
  date -u
  nvidia-smi -L
  nvidia-smi topo -m
  nvidia-smi nvlink --status 2>&1 | head -40
} >"$out/topology.txt" 2>&1
timeout "${BENCH_TIMEOUT:-330}" python3 -m bench.multi_gpu --out "$out" "$@" 2>&1 |
  tee "$out/multi_gpu.log" | tail -n 40
timeout "${TORCH_TIMEOUT:-150}" python3 -m bench.torch_ep --out "$out" 2>&1 |
  tee "$out/torch_ep.log" | grep '^{' | tail -n 8
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -n 0 -q -p no:cacheprovider -m gpu \
  tests/mok_jax/test_expert_parallel.py 2>&1 | tee "$out/multi_gpu_tests.log" | tail -n 15
