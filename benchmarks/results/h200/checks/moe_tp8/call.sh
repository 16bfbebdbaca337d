#!/bin/bash
# One device call on one GPU (nvidia-h200, carry .whl): the fused-MoE tile table for a TP8 rank's expert shard
# (E=256, N=256, K=7168, block FP8) at decode token counts, then rank 0 of TP8 of V3's full geometry alone
# (bench_one_batch.py --rank-of 8, decode only) without and with that table, in the same call.
# Results in $OUT/moe_tp8/ (the table, the tuner's every candidate, both bench logs and JSON).
set -u
source <(sed -n '/^setup_env()/,/^}/p' benchmarks/gpu.sh)
setup_env > /dev/null
out=${OUT:-/tmp/moe_tp8}/moe_tp8
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$out/env.txt"
table=kernels/configs/moe/E=256,N=256,K=7168,device_name=NVIDIA_H200,dtype=fp8_w8a8.json
rm -f "$table"
bench=(python3 benchmarks/bench_one_batch.py --layers 61 --first-dense 3 --rank-of 8 --batch 1 8 32 128 --ctx 1024
       --prefill --attention-backend triton --moe-backend deep_gemm --gemm-backend deep_gemm --skip-transformers)
timeout -k 5 120 "${bench[@]}" --out "$out/before.json" > "$out/before.log" 2>&1
echo "before: exit $?" >> "$out/env.txt"
timeout -k 5 260 python3 benchmarks/tune_moe.py --inter 256 --tokens 1 8 16 32 64 128 --space full --fill-defaults \
  --time-budget-s 220 --results "$out/tune_results.json" > "$out/tune.log" 2>&1
echo "tune: exit $?" >> "$out/env.txt"
cp "$table" "$out/" 2>/dev/null || echo "no table written" >> "$out/env.txt"
timeout -k 5 120 "${bench[@]}" --out "$out/after.json" > "$out/after.log" 2>&1
echo "after: exit $?" >> "$out/env.txt"
cat "$out/env.txt"; grep -E "^T=|wrote|budget" "$out/tune.log"; grep -hE "B=" "$out/before.log" "$out/after.log" | cut -c1-200
