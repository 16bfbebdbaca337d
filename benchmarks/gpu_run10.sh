#!/usr/bin/env bash
# One device call: the fused RMSNorm / RoPE kernels (GPU tests, then the engines that use them), NextN with and
# without them (PDSERVE_TORCH_NORM_ROPE=1 keeps the torch references), and the V3-slice decode step at batch 1.
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run10.log") 2>&1
time timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_norm_rope.py tests/test_gpu_engine.py \
  tests/test_gpu_spec.py 2>&1 | tail -8
time timeout 150 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$OUT/spec.json" --v3-layers 0 \
  --divergence-prompts 16 --repeats 3
echo "== torch references for RMSNorm / RoPE (as before) =="
time PDSERVE_TORCH_NORM_ROPE=1 timeout 60 python3 benchmarks/bench_spec.py --model models/tiny-trained \
  --out "$OUT/spec_torch_norm.json" --v3-layers 0 --batch 1 --divergence-prompts 0 --repeats 3 | grep "B="
for ref in 0 1; do
  echo "== V3 slice decode, PDSERVE_TORCH_NORM_ROPE=$ref =="
  PDSERVE_TORCH_NORM_ROPE=$ref timeout 80 python3 benchmarks/bench_one_batch.py --out "$OUT/one_batch_ref$ref.json" \
    --layers 4 --batch 1 8 --ctx 1024 --prefill --skip-transformers --gemm-backend scaled_mm 2>&1 | tail -6
done
