#!/usr/bin/env bash
# One device call: NextN benchmark with chained draft graphs (+ host profile at B=1), then every GPU test.
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run2.log") 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
time timeout 200 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$OUT/spec.json" --profile
time timeout 330 python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/test_gpu_spec.py tests/test_gpu_moe_gemm.py \
  tests/test_gpu_engine.py tests/test_gpu_attention.py 2>&1 | tail -40
