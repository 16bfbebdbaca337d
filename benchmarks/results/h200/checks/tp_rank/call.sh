#!/bin/bash
# One device call on one GPU (nvidia-h200, carry .whl): the V3 slice's decode step and prefill on one GPU beside
# rank 0 of a TP2 (and an EP2) worker run alone with its collectives skipped (bench_one_batch.py --rank-of 2), the
# engine's backends (graphed decode: Triton MLA; DeepGEMM MoE and GEMMs), each shape's busiest kernels.
# Logs and JSON in $OUT/tp_rank/.
set -u
source <(sed -n '/^setup_env()/,/^}/p' benchmarks/gpu.sh)
setup_env > /dev/null
out="${OUT:-/tmp/tp_rank-call}/tp_rank"
mkdir -p "$out"
{ nvidia-smi -L; git log -1 --format='tree %h %s'; git status --short -- benchmarks pdserve kernels; } > "$out/env.txt" 2>&1
common=(--layers 4 --batch 1 32 128 --ctx 1024 --prefill 4096 16384 --attention-backend triton
        --moe-backend deep_gemm --gemm-backend deep_gemm --skip-transformers --profile)
for cfg in "tp1:" "tp2-rank:--rank-of 2" "ep2-rank:--rank-of 2 --ep"; do
  name=${cfg%%:*}; flags=${cfg#*:}
  timeout -k 5 200 python3 benchmarks/bench_one_batch.py --out "$out/$name.json" "${common[@]}" $flags \
    > "$out/$name.log" 2>&1
  echo "$name: exit $?" >> "$out/env.txt"
done
cat "$out/env.txt"
for name in tp1 tp2-rank ep2-rank; do echo "== $name"; grep "^\[bench\]" "$out/$name.log"; done
for name in tp1 tp2-rank ep2-rank; do echo "== $name profiles"; grep "^\[profile\]" "$out/$name.log" | head -120; done
