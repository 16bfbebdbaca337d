#!/usr/bin/env bash
# One device call: the FlashInfer tests (eager and under CUDA graphs) after FlashInferMLADecode.plan waits for the
# previous plan's upload before re-planning.   (device) bash benchmarks/gpu_run18.sh -> $OUT/run18.log
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run18.log") 2>&1
time timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_flashinfer_graphs.py \
  tests/test_gpu_attention.py -k "flashinfer" 2>&1 | tail -30
