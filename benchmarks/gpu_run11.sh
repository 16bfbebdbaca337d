#!/usr/bin/env bash
# One device call: the fused RMSNorm / RoPE GPU tests (tolerances in rounding steps), then the V3-slice decode step
# with them at batch 1-128, contexts 1k and 4k.
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run11.log") 2>&1
time timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_norm_rope.py 2>&1 | tail -15
time timeout 200 python3 benchmarks/bench_one_batch.py --out "$OUT/one_batch.json" --layers 4 --batch 1 8 32 128 \
  --ctx 1024 4096 --prefill --skip-transformers --gemm-backend scaled_mm 2>&1 | tail -12
