#!/usr/bin/env bash
# Issue 4, one device call (~2 min of GPU, capped at 295 s): the fused-MoE prefill tile sweep, then the MoE part of
# bench_moe_gemm.py with the winners. tune_moe.py --space prefill checks 4 gate-up and 8 down configs (fused, and
# contiguous-layout down GEMMs) on sampled pairs and times each (compiled once) at T = 4096, 8192 and 16384,
# printing TF/s and the fraction of cuBLAS FP8 measured in the same run. Files in $OUT:
#   sweep.log        everything printed
#   moe_config.json  the table to commit as kernels/configs/moe/<name printed at the end of the sweep>
#                    (tuned at 4096/8192/16384, moe_configs.default_config entries at the other token counts)
#   moe_sweep.json   every candidate: ms, TF/s, fraction of cuBLAS, check error
#   moe_gemm.json    bench_moe_gemm.py --skip-dense with moe_config.json
source benchmarks/gpu_env.sh
set -uo pipefail
exec > >(tee "$OUT/sweep.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  'triton', triton.__version__)"
time timeout 235 python3 benchmarks/tune_moe.py --space prefill --tokens 4096 8192 16384 --time-budget-s 200 \
  --out "$OUT/moe_config.json" --fill-defaults --results "$OUT/moe_sweep.json"
if [ -s "$OUT/moe_config.json" ]; then
  time timeout 45 python3 benchmarks/bench_moe_gemm.py --skip-dense --moe-tokens 4096 8192 16384 \
    --moe-config "$OUT/moe_config.json" --out "$OUT/moe_gemm.json"
else
  echo "no moe_config.json (the sweep tuned nothing): benchmark with the untuned default configs"
  time timeout 45 python3 benchmarks/bench_moe_gemm.py --skip-dense --moe-tokens 4096 8192 16384 --out "$OUT/moe_gemm.json"
fi
