#!/bin/bash
# One device call on one GPU (nvidia-h200, carry .whl): kv2's cuda_ipc kernel path again (3f842ce) with the index
# fix (kv2_cuda_ipc_fixed.patch: the GRANT waits for the slot index's copy to reach the device), applied to the
# device's copy of the tree only: its GPU transport tests, then the served V3 slice at c=1 and c=32 with 64 prompts
# each (the run that hit the illegal memory access), with CUDA_LAUNCH_BLOCKING unset (the speed of the real path).
# Logs in $OUT/kv2_fixed/. Pass: tests pass and c=32 completes 64/64 with 0 failed.
set -u
source <(sed -n '/^setup_env()/,/^}/p' benchmarks/gpu.sh)
setup_env > /dev/null
here=benchmarks/results/h200/checks/kv2_serving
out=${OUT:-/tmp/kv2f}/kv2_fixed
mkdir -p "$out"
nvidia-smi -L > "$out/env.txt"
git apply "$here/kv2_cuda_ipc_fixed.patch" || { echo "the patch does not apply" | tee -a "$out/env.txt"; exit 1; }
timeout -k 5 150 python3 -m pytest -x -q -p no:cacheprovider tests/test_gpu_kv_ipc.py > "$out/tests.log" 2>&1
echo "tests: exit $?" >> "$out/env.txt"
timeout -k 5 300 python3 benchmarks/bench_serving.py --out "$out/serving" --models v3 --cuda-graph-max-bs 128 \
  --prompts-only-concurrency 0 --concurrency 1 32 --num-prompts 64 --skip-engine > "$out/serving.log" 2>&1
echo "serving: exit $?" >> "$out/env.txt"
up=$(ls "$out"/serving/*up.log 2>/dev/null | head -1)
if [ -n "$up" ]; then grep -c "illegal memory access" "$up" > "$out/illegal_count.txt"; tail -c 200000 "$up" > "$out/up_tail.log"; rm -f "$up"; fi
git apply -R "$here/kv2_cuda_ipc_fixed.patch"
cat "$out/env.txt"; tail -3 "$out/tests.log"; grep -E "c=|up after" "$out/serving.log" | cut -c1-260
