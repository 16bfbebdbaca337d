#!/usr/bin/env bash
# Issue 4, one device call: the contiguous-layout grouped GEMM (kernels/triton_grouped_gemm.py: TMA loads, DeepGEMM's
# m_grouped_fp8_gemm_nt_contiguous contract) at V3 MoE shapes, without warp specialization (which hung in
# gpu_run20 and in a 3-case diagnostic run: TMA alone ran correctly, both warp-specialized cases hung).
# 1. its GPU tests against the contract's torch reference; 2. bench_moe_gemm.py --contiguous: each tile's gate-up
#    and down GEMMs and the whole layer at T = 4096, 8192, 16384, next to the fused kernel with the committed table,
#    all as fractions of cuBLAS FP8 measured in the same run.
#   (device) bash benchmarks/gpu_run21.sh   -> $OUT/run21.log, moe_contiguous.json
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run21.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
time timeout 120 python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu_moe_gemm.py -k "contiguous_grouped" 2>&1 \
  | grep -E "contiguous T=|passed|failed|Error" | tail -30
time timeout 200 python3 benchmarks/bench_moe_gemm.py --skip-dense --contiguous --moe-tokens 4096 8192 16384 \
  --out "$OUT/moe_contiguous.json"
