#!/usr/bin/env bash
# One device call: GPU tests (MLA decode tiles, the restructured fused MoE, graphed speculation), the MLA decode
# tile sweep, and the NextN benchmark with alternating plain / NextN runs.
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run7.log") 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
time timeout 210 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_attention.py tests/test_gpu_moe_gemm.py \
  tests/test_gpu_spec.py tests/test_gpu_engine.py 2>&1 | tail -15
bash benchmarks/gpu_mla_sweep.sh
time timeout 170 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$OUT/spec.json" --v3-layers 0 \
  --divergence-prompts 16 --repeats 3
