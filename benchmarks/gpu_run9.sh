#!/usr/bin/env bash
# One device call: GPU tests of graphed speculation (extend queued before the round's read), then the NextN
# benchmark with alternating plain / NextN runs at batch 1, 8, 32.
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run9.log") 2>&1
time timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_spec.py tests/test_gpu_engine.py 2>&1 | tail -5
time timeout 200 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$OUT/spec.json" --v3-layers 0 \
  --divergence-prompts 16 --repeats 3 --host-phases
