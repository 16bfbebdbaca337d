#!/usr/bin/env bash
# One device call: GPU tests of graphed decode and speculation (packed graph inputs, draft extend queued before the
# host's bookkeeping), the NextN benchmark with a GPU-busy timeline, then the MLA decode tile sweep.
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run6.log") 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
time timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_spec.py tests/test_gpu_engine.py 2>&1 | tail -5
time timeout 150 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$OUT/spec.json" --v3-layers 0 \
  --divergence-prompts 16 --timeline
if [ -f benchmarks/gpu_mla_sweep.sh ]; then time bash benchmarks/gpu_mla_sweep.sh; fi
