#!/usr/bin/env bash
# Issue 4, one device call: FlashInfer MLA decode inside the engine's CUDA graphs (its tests, the engine and
# speculation GPU tests), then the V3-slice decode step with FlashInfer attention, graphed (with the host time of
# the per-step re-plan). The triton numbers of the same command are in gpu_run16_h100.log.
#   (device) bash benchmarks/gpu_run17.sh   -> $OUT/run17.log, one_batch_flashinfer.json
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run17.log") 2>&1
time timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_flashinfer_graphs.py \
  tests/test_gpu_attention.py -k "flashinfer" 2>&1 | tail -40
time timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_gpu_spec.py 2>&1 | tail -15
time timeout 60 python3 benchmarks/bench_one_batch.py --out "$OUT/one_batch_flashinfer.json" --layers 4 \
  --batch 1 8 32 --ctx 4096 --prefill --skip-transformers --attention-backend flashinfer --gemm-backend scaled_mm
