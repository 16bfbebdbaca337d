#!/usr/bin/env bash
# One device call: NextN benchmark on the committed model (several prompts at small batch), then a time-boxed
# fused-MoE tile search at T=4096/8192 and the MoE benchmark with the tuned configs.
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run4.log") 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
time timeout 150 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$OUT/spec.json" --v3-layers 0
time timeout 260 python3 benchmarks/tune_moe.py --tokens 4096 8192 --time-budget-s 220
cp kernels/configs/moe/*.json "$OUT/" 2>/dev/null; ls kernels/configs/moe
time timeout 120 python3 benchmarks/bench_moe_gemm.py --skip-dense --out "$OUT/moe_gemm.json"
