#!/usr/bin/env bash
# Issue 4 in one device call: sweep the Triton MLA decode kernel's tiles and split counts next to FlashInfer.
#   (device) bash benchmarks/gpu_mla_sweep.sh   -> $OUT/mla_sweep.json, $OUT/mla_sweep.log   (60-110 s, most of it
#   FlashInfer's JIT build, which overlaps the sweep)
# The log holds the lines to paste into kernels/triton_mla_decode.py and ends with a SUMMARY per head count.
# MLA_TESTS=1 also runs the triton decode GPU tests afterwards (about 60 s more).
set -uo pipefail
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/mla_sweep.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
time timeout 150 python3 benchmarks/bench_mla_decode.py --sweep --time-budget-s 100 --out "$OUT/mla_sweep.json"
if [ "${MLA_TESTS:-0}" = 1 ]; then
  time timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_attention.py -k "mla_decode and triton" \
    2>&1 | tail -15
fi
