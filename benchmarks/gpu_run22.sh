#!/usr/bin/env bash
# Issue 4, one device call (~6 min): the fused MoE with the down GEMM on the contiguous layout (TMA grouped GEMM).
# 1. GPU tests of the MoE / GEMM kernels (tests/test_gpu_moe_gemm.py, all of it: the fused kernel gained a
#    constexpr); 2. bench_moe_gemm.py with the committed table (before); 3. tune_moe.py --space prefill at
#    T = 4096, 8192, 16384, written over the committed table in this copy (other token counts kept);
#    4. bench_moe_gemm.py with it (after); 5. V3-slice prefill at 1k / 4k / 16k tokens with it.
#   (device) bash benchmarks/gpu_run22.sh   -> $OUT/run22.log, moe_*.json, prefill.json, the new table
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run22.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
table=kernels/configs/moe/E=256,N=2048,K=7168,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8.json
time timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_moe_gemm.py 2>&1 | tail -12
time timeout 60 python3 benchmarks/bench_moe_gemm.py --skip-dense --moe-tokens 4096 8192 16384 --out "$OUT/moe_before.json"
time timeout 200 python3 benchmarks/tune_moe.py --space prefill --tokens 4096 8192 16384 --time-budget-s 180 \
  --results "$OUT/moe_sweep.json"
cp "$table" "$OUT/moe_table.json"
time timeout 60 python3 benchmarks/bench_moe_gemm.py --skip-dense --moe-tokens 4096 8192 16384 --out "$OUT/moe_after.json"
time timeout 90 python3 benchmarks/bench_one_batch.py --out "$OUT/prefill.json" --layers 4 --batch 1 --ctx 1024 \
  --no-graph --skip-transformers --attention-backend flashinfer --moe-backend triton --gemm-backend scaled_mm
