#!/usr/bin/env bash
# Issue 4, one device call (~4 min): the whole MoE / GEMM GPU test file after the Gluon grouped GEMM and the
# both-contiguous MoE pipeline (tests/test_gpu_moe_gemm.py), printing each kernel's error.
#   (device) bash benchmarks/gpu_run25.sh   -> $OUT/run25.log
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run25.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
time timeout 400 python3 -m pytest -q -p no:cacheprovider -rfE -s tests/test_gpu_moe_gemm.py 2>&1 \
  | grep -E "both contiguous|gluon|passed|failed|Error" | tail -40
