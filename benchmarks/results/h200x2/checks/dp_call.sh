#!/bin/bash
# One device call on two GPUs (nvidia-h200-x2, carry .whl): DP attention in the decode tier (issue 45 item 4). The
# GPU tests of prefilled requests joining a TP2 and a DP-attention engine (KV moved between ranks over NCCL), then
# `pdserve up --gpus 0,1 --tp 2 --dp-attention` (TP2 prefill, TP2 + DP attention decode) on the V3 slice, 2048 in /
# 64 out, c=1, 32, 128, through bench_serving (0 failed is the check; its TPOT beside pd_tp2's). Logs in $OUT/dp/.
set -u
source <(sed -n '/^setup_env()/,/^}/p' benchmarks/gpu.sh)
setup_env > /dev/null
out=${OUT:-/tmp/dp-call}/dp
mkdir -p "$out"
{ nvidia-smi -L; git log -1 --format='tree %h %s'; } > "$out/env.txt" 2>&1
timeout -k 5 "${TEST_TIMEOUT:-150}" python3 -m pytest -x -s -v -p no:cacheprovider tests/test_gpu_tp.py \
  -k "join or trained_model" > "$out/tests.log" 2>&1
echo "tests: exit $?" | tee -a "$out/env.txt"
grep -E "PASS|FAIL|Error|passed|failed" "$out/tests.log" | cut -c1-300 | tail -12
timeout -k 5 "${BENCH_TIMEOUT:-400}" python3 benchmarks/bench_serving.py --out "$out/serving" --models v3 \
  --cuda-graph-max-bs 128 --prompts-only-concurrency 0 --concurrency 1 32 128 --num-prompts 32 --skip-engine \
  --up-arg=--gpus=0,1 --up-arg=--tp=2 --up-arg=--dp-attention > "$out/serving.log" 2>&1
echo "serving: exit $?" | tee -a "$out/env.txt"
grep -E "c=|failed|up after|error" "$out/serving.log" | cut -c1-300 | tail -12
