#!/bin/bash
# One device call on one GPU (nvidia-h200, carry .whl): the served V3 slice (both tiers on the GPU, KV over
# cuda_ipc) with kv_transfer as of b9fa110 (one-kernel room copies, 3f842ce/b9fa110), then as of 02138f8 (gather +
# scatter on a side stream), c=1 and c=32. Logs in $OUT/kv2_serving/. Needs the device's copy of .git to hold both
# commits (at the time it was stale, so the two kv_transfer folders were sent as a tarball made by
# `git archive 02138f8 kv_transfer`, untracked, and the tree itself was b9fa110's).
set -u
source <(sed -n '/^setup_env()/,/^}/p' benchmarks/gpu.sh)
setup_env > /dev/null
out=${OUT:-/tmp/kv2s}/kv2_serving
mkdir -p "$out"
nvidia-smi -L > "$out/env.txt"
for arm in new old; do
  git archive "$([ "$arm" = old ] && echo 02138f8 || echo b9fa110)" kv_transfer | tar -x
  timeout -k 5 270 python3 benchmarks/bench_serving.py --out "$out/$arm" --models v3 --cuda-graph-max-bs 128 \
    --prompts-only-concurrency 0 --concurrency 1 32 --num-prompts 32 --skip-engine > "$out/$arm.log" 2>&1
  echo "$arm: exit $?" >> "$out/env.txt"
done
cat "$out/env.txt"
for arm in new old; do echo "== $arm"; grep -E "c=|up after|failed" "$out/$arm.log" | cut -c1-260 | tail -5; done
