#!/usr/bin/env bash
# One device call: graphed decode and speculation with packed graph inputs (after reverting the whole-table packing), then the
# NextN benchmark (alternating plain / NextN runs at batch 1, 8, 32).
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run13.log") 2>&1
time timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_spec.py tests/test_gpu_engine.py 2>&1 | tail -5
time timeout 150 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$OUT/spec.json" --v3-layers 0 \
  --divergence-prompts 16 --repeats 3 --host-phases
