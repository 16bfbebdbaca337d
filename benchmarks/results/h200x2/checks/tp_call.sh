#!/bin/bash
# One device call on two GPUs (nvidia-h200-x2, carry .whl): a TP2 generate on the tiny model with CUDA graphs (and
# without, ALSO_NOGRAPH=1; faulthandler dumps every thread's stack if it stalls), then the TP GPU tests. Logs in $OUT/tp/.
set -u
source <(sed -n '/^setup_env()/,/^}/p' benchmarks/gpu.sh)
setup_env > /dev/null
out=${OUT:-/tmp/tp-call}/tp
mkdir -p "$out"
{ nvidia-smi -L; nvidia-smi topo -m; git log -1 --format='tree %h %s'; } > "$out/env.txt" 2>&1
gen() {  # $1: log name, rest: extra flags
  local name=$1; shift
  local t0=$(date +%s.%N)
  PYTHONFAULTHANDLER=1 NCCL_DEBUG=WARN timeout -k 5 -s ABRT "${GEN_TIMEOUT:-60}" python3 -m pdserve generate \
    --model models/tiny-trained --device cuda --tp 2 --dtype float32 --input-ids 5,6,7 --max-new-tokens 8 \
    --collective-timeout 30 --json "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? in $(python3 -c "import time; print(round(time.time()-$t0, 1))") s" | tee -a "$out/env.txt"
}
gen tp2_graph
[ -n "${ALSO_NOGRAPH:-}" ] && gen tp2_nograph --disable-cuda-graph
for f in "$out"/tp2_*.log; do tail -n 2 "$f"; done
# -s: a stalled test's stacks (faulthandler, at the test's limit) reach the log instead of pytest's capture
timeout -k 5 "${TEST_TIMEOUT:-330}" python3 -m pytest -x -s -v -p no:cacheprovider tests/test_gpu_tp.py \
  > "$out/tests.log" 2>&1
echo "tests: exit $?" | tee -a "$out/env.txt"
grep -v "^\s*$" "$out/tests.log" | grep -v "Extension modules\|^frame\|pluggy\|_pytest" | cut -c1-300 | tail -40
