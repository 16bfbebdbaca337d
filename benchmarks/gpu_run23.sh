#!/usr/bin/env bash
# Issue 4, one device call (~5 min): the Gluon grouped GEMM (kernels/gluon_grouped_gemm.py, each K step's promotion
# under the next step's wgmma). 1. its GPU tests against DeepGEMM's contract in torch (and the Triton contiguous
# GEMM's, as before); 2. bench_moe_gemm.py at T = 4096 / 8192 / 16384: the committed fused table, the Triton
# contiguous tiles and the Gluon tiles, each GEMM against cuBLAS FP8 measured in the same run.
#   (device) bash benchmarks/gpu_run23.sh   -> $OUT/run23.log, $OUT/moe_gluon.json
# NOTE: gpu_run24 replaced the Gluon tile list (bench_moe_gemm.GLUON_CONTIGUOUS); moe_gluon_run23_h100.json records
# the tiles this run timed.
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/run23.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
time timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -s tests/test_gpu_moe_gemm.py \
  -k "gluon or contiguous_grouped" 2>&1 | grep -E "gluon|contiguous T=|passed|failed|Error|error" | tail -60
time timeout 300 python3 benchmarks/bench_moe_gemm.py --skip-dense --moe-tokens 4096 8192 16384 --contiguous --gluon \
  --out "$OUT/moe_gluon.json"
