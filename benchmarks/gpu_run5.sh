#!/usr/bin/env bash
# One short device call: GPU tests of graphed speculation and decode, then the NextN benchmark (device-side rounds).
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run5.log") 2>&1
time timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_spec.py tests/test_gpu_engine.py 2>&1 | tail -5
time timeout 120 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$OUT/spec.json" --v3-layers 0 \
  --divergence-prompts 16
