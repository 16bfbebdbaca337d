#!/usr/bin/env bash
# Issue 4, one device call (~4 min): after gpu_run23, the Gluon grouped GEMM's stage / GROUP_M / unroll space at
# 128-row tiles, and the weight-read floor of each MoE GEMM (expert bytes / copy bandwidth, same run).
# 1. the contiguous grouped GEMM tests (Triton and Gluon, one parametrized test now); 2. bench_moe_gemm.py at
# T = 4096 / 8192 / 16384: the committed fused table (with the weight-read caps) and the Gluon tiles.
#   (device) bash benchmarks/gpu_run24.sh   -> $OUT/run24.log, $OUT/moe_gluon_sweep.json
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run24.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
time timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_moe_gemm.py \
  -k "gluon or contiguous_grouped" 2>&1 | tail -4
time timeout 300 python3 benchmarks/bench_moe_gemm.py --skip-dense --moe-tokens 4096 8192 16384 --gluon \
  --out "$OUT/moe_gluon_sweep.json"
