#!/bin/bash
# The vocab-parallel lm_head's A/B on two GPUs (nvidia-h200-x2, carry .whl), issue 45: the same tree without and
# with vocab_head.patch (lm_head split by vocabulary rows, its logits all-gathered; CPU-tested, not on main until
# this shows a client-visible win). One device call per part:
#   PART=engine  bench_tp.py tp1 + tp2 (decode step at batch 1/32/128, prefill 4k/16k, profiled), base then patched
#   PART=served  `pdserve up --gpus 0,1 --tp 2` (TP2 prefill + TP2 decode over both GPUs, the V3 slice, 2048 in /
#                64 out) at c=1 and c=32 through bench_serving, base then patched: TPOT is the client-visible number
# Logs in $OUT/vocab_head/. The patch is applied with `git apply` to the device's copy of the tree only.
set -u
source <(sed -n '/^setup_env()/,/^}/p' benchmarks/gpu.sh)
setup_env > /dev/null
here=benchmarks/results/h200x2/checks/vocab_head
out=${OUT:-/tmp/vh-call}/vocab_head
mkdir -p "$out"
{ nvidia-smi -L; git log -1 --format='tree %h %s'; } > "$out/env.txt" 2>&1
part=${PART:-engine}
for arm in base patched; do
  if [ "$arm" = patched ]; then
    git apply "$here/vocab_head.patch" || { echo "the patch does not apply to this tree" | tee -a "$out/env.txt"; exit 1; }
  fi
  if [ "$part" = engine ]; then
    timeout -k 5 280 python3 benchmarks/bench_tp.py --out "$out/tp_$arm" --configs tp1 tp2 --skip-big --profile \
      --time-budget-s 260 > "$out/tp_$arm.log" 2>&1
  else
    timeout -k 5 280 python3 benchmarks/bench_serving.py --out "$out/serving_$arm" --models v3 \
      --cuda-graph-max-bs 128 --prompts-only-concurrency 0 --concurrency 1 32 --num-prompts 32 --skip-engine \
      --up-arg=--gpus=0,1 --up-arg=--tp=2 > "$out/serving_$arm.log" 2>&1
  fi
  echo "$part $arm: exit $?" | tee -a "$out/env.txt"
done
git apply -R "$here/vocab_head.patch"
for arm in base patched; do
  echo "== $arm"
  if [ "$part" = engine ]; then grep -E "decode batch|prefill .* tok/s|profiled" "$out/tp_$arm.log" | cut -c1-200
  else grep -E "c=|failed|up after" "$out/serving_$arm.log" | cut -c1-300 | tail -6; fi
done
