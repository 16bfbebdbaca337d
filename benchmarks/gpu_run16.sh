#!/usr/bin/env bash
# Issue 4, one device call: FlashInfer MLA decode inside the engine's CUDA graphs (tests, then the V3-slice decode
# step with triton vs flashinfer attention, both graphed), and the fused-MoE prefill sweep. At the time of the run
# (gpu_run16_h100.log) the tuner also held "K_PAIR" tiles, reverted since (slower; benchmarks/results/README.md).
#   (device) bash benchmarks/gpu_run16.sh   -> $OUT/run16.log, one_batch_{triton,flashinfer}.json, moe_*.json
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run16.log") 2>&1
time timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_flashinfer_graphs.py tests/test_gpu_engine.py \
  tests/test_gpu_spec.py tests/test_gpu_attention.py -k "not triton_configs and not ragged" 2>&1 | tail -15
time timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_moe_gemm.py -k "tile_variants or graph" 2>&1 | tail -8
for be in triton flashinfer; do
  time timeout 45 python3 benchmarks/bench_one_batch.py --out "$OUT/one_batch_$be.json" --layers 4 --batch 1 8 32 \
    --ctx 4096 --prefill --skip-transformers --attention-backend $be --gemm-backend scaled_mm
done
time timeout 200 python3 benchmarks/tune_moe.py --space prefill --tokens 4096 8192 --time-budget-s 165 \
  --out "$OUT/moe_config.json" --fill-defaults --results "$OUT/moe_sweep.json"
[ -s "$OUT/moe_config.json" ] && time timeout 40 python3 benchmarks/bench_moe_gemm.py --skip-dense \
  --moe-tokens 4096 8192 --moe-config "$OUT/moe_config.json" --out "$OUT/moe_gemm.json"
