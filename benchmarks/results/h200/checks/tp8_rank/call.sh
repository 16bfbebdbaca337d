#!/bin/bash
# One device call on one GPU (nvidia-h200, carry .whl): rank 0 of a TP8 worker of DeepSeek-V3's full geometry
# (61 layers, the first 3 dense, + NextN; 256 experts, 128 heads; block-FP8 dummy weights) built alone on this GPU,
# every collective skipped (bench_one_batch.py --rank-of 8), with the MoE split by intermediate (TP8) and by experts
# (--ep: EP8): the kernels one GPU of the eight holds in a decode step (batch 1, 32, 128 at ctx 1024) and a prompt
# (4k, 16k), against that GPU's read floor. A lower bound of issue 47's TP8 step: no all-reduce, no waiting.
# Logs and JSON in $OUT/tp8_rank/.
set -u
source <(sed -n '/^setup_env()/,/^}/p' benchmarks/gpu.sh)
setup_env > /dev/null
out=${OUT:-/tmp/tp8}/tp8_rank
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$out/env.txt"
common=(--layers 61 --first-dense 3 --rank-of 8 --batch 1 32 128 --ctx 1024 --prefill 4096 16384
        --attention-backend triton --moe-backend deep_gemm --gemm-backend deep_gemm --skip-transformers --profile)
timeout -k 5 280 python3 benchmarks/bench_one_batch.py --out "$out/tp8.json" "${common[@]}" > "$out/tp8.log" 2>&1
echo "tp8: exit $?" >> "$out/env.txt"
timeout -k 5 250 python3 benchmarks/bench_one_batch.py --out "$out/ep8.json" "${common[@]}" --ep > "$out/ep8.log" 2>&1
echo "ep8: exit $?" >> "$out/env.txt"
cat "$out/env.txt"; grep -hE "^\[bench\]" "$out/tp8.log" "$out/ep8.log" | cut -c1-220
