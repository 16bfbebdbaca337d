#!/usr/bin/env bash
# One device call: GPU tests of graphed decode and speculation, then the NextN benchmark (alternating plain / NextN
# runs at batch 1, 8, 32, with the host-phase breakdown). The log is $OUT/<name>.log:
#   bash benchmarks/gpu_spec_bench.sh run13    # what made benchmarks/results/gpu_run9/12/13_h100.log
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/${1:-spec_bench}.log") 2>&1
time timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_spec.py tests/test_gpu_engine.py 2>&1 | tail -5
time timeout 200 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$OUT/spec.json" --v3-layers 0 \
  --divergence-prompts 16 --repeats 3 --host-phases
