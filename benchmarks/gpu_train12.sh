#!/usr/bin/env bash
# Issue 5, one device call: train a deeper demo model (12 main layers; one MTP layer is then a smaller part of a
# target step, as in DeepSeek-V3), bring it back, and run the GPU speculation tests and the NextN benchmark on it.
#   (device) STEPS=2500 bash benchmarks/gpu_train12.sh
# Device files come back at most 16 MiB each, so model.safetensors returns in two parts (cat them back together).
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/train12.log") 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
rm -rf models/tiny-trained
time python3 scripts/train_tiny.py --out models/tiny-trained --device cuda --steps "${STEPS:-2500}" --layers 12 \
  --check-prompts 0
(cd models/tiny-trained && split -b 9M model.safetensors model.safetensors.part- \
  && cp config.json tokenizer.json tokenizer_config.json train_metrics.json model.safetensors.part-* "$OUT/")
time timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_spec.py 2>&1 | tail -5
time timeout 120 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$OUT/spec.json" --v3-layers 0 \
  --divergence-prompts 16 --repeats 3 --host-phases
