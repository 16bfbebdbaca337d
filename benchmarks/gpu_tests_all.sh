#!/usr/bin/env bash
# Every single-GPU test in one device call (tests/test_gpu_kv_nccl.py needs two GPUs and skips on one):
#   (device) bash benchmarks/gpu_tests_all.sh NAME   -> $OUT/NAME.log
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/${1:-gpu_tests}.log") 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
time timeout 540 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_gpu_*.py 2>&1 | tail -40
