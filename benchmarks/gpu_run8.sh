#!/usr/bin/env bash
# One device call: GPU tests of the adopted MLA decode tiles and the fused MoE (fp32 activation on the unfused
# path), the fused-MoE prefill tile sweep + benchmark, the MLA decode benchmark with the new defaults, and NextN
# at k=2 for comparison with k=3.
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run8.log") 2>&1
time timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_moe_gemm.py tests/test_gpu_attention.py \
  2>&1 | tail -8
bash benchmarks/gpu_moe_sweep.sh
time timeout 70 python3 benchmarks/bench_mla_decode.py --out "$OUT/mla_decode.json" 2>&1 | tail -12
time timeout 45 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$OUT/spec_k2.json" --v3-layers 0 \
  --batch 1 --steps 2 --divergence-prompts 0 --repeats 3 2>&1 | grep "B="
