#!/usr/bin/env bash
# Issue 5 on one GPU, in one device call: train the demo model, keep it, benchmark NextN, test graphed speculation.
#   (device) bash benchmarks/gpu_spec_run.sh      -> $OUT/{model files, train_metrics.json, spec.json, run.log}
# V3_LAYERS=0 skips the DeepSeek-V3-slice overhead part of the benchmark.
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
rm -rf models/tiny-trained
time python3 scripts/train_tiny.py --out models/tiny-trained --device cuda --steps "${STEPS:-3000}"
cp models/tiny-trained/* "$OUT/"
time timeout 300 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$OUT/spec.json" --profile \
  --v3-layers "${V3_LAYERS:-4}"
time timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_spec.py tests/test_gpu_engine.py 2>&1 | tail -15
