#!/bin/bash
# One device call on one GPU (nvidia-h200, carry .whl): decode's dense linears on the Triton kernel up to 16 rows
# (small_m_triton.patch) against scaled_mm (main), through `pdserve up` on the V3 slice (2048 in / 64 out) at
# concurrency 1 and 8 (decode batches of at most 8 rows: the patch's rows), base then patched, in one call. TPOT is
# the client-visible number. Logs in $OUT/decode_linear_ab/. The patch goes onto the device's copy of the tree only.
set -u
source <(sed -n '/^setup_env()/,/^}/p' benchmarks/gpu.sh)
setup_env > /dev/null
here=benchmarks/results/h200/checks/decode_linear
out=${OUT:-/tmp/dl-ab}/decode_linear_ab
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/env.txt"
for arm in base patched; do
  if [ "$arm" = patched ]; then
    git apply "$here/small_m_triton.patch" || { echo "the patch does not apply" | tee -a "$out/env.txt"; exit 1; }
  fi
  limit=$([ "$arm" = base ] && echo 190 || echo 110)
  timeout -k 5 "$limit" python3 benchmarks/bench_serving.py --out "$out/serving_$arm" --models v3 \
    --cuda-graph-max-bs 128 --prompts-only-concurrency 0 --concurrency 1 8 --num-prompts 32 --skip-engine \
    > "$out/serving_$arm.log" 2>&1
  echo "$arm: exit $?" >> "$out/env.txt"
done
git apply -R "$here/small_m_triton.patch"
cat "$out/env.txt"; grep -hE "c=|up after" "$out"/serving_*.log | cut -c1-250
