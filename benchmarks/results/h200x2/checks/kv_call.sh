#!/bin/bash
# One device call on two GPUs (nvidia-h200-x2, carry .whl): bench_kv_transfer.py for cuda_ipc, nccl and nixl (each
# case at the senders' default cap on runs per send and at 1, a send crossing whole), a 4k-token room of each traced
# (where its time goes), then the kv GPU tests.
# Logs and JSON in $OUT/kv.tgz.
set -u
source <(sed -n '/^setup_env()/,/^}/p' benchmarks/gpu.sh)
setup_env > /dev/null
out=/tmp/kv-call/kv
mkdir -p "$out"
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1; git log -1 --format='tree %h %s';
  git status --short -- kv_transfer benchmarks tests; python3 -c 'import torch; print("torch", torch.__version__)'; } \
  > "$out/env.txt" 2>&1
for b in cuda_ipc:100 nccl:120 nixl:90; do
  timeout -k 5 "${b#*:}" python3 benchmarks/bench_kv_transfer.py --backend "${b%%:*}" --out "$out/kv_${b%%:*}.json" \
    --iters 6 --max-chunks 8 1 > "$out/bench_${b%%:*}.log" 2>&1
  echo "bench ${b%%:*}: exit $?" >> "$out/env.txt"
done
# Where a 4k-token room's time goes, per transport: its points on both sides (PDSERVE_TRACE, kv.* marks),
# timed from the rows' hand-over (trace_report.py --origin kv.send).
for b in cuda_ipc nccl nixl; do
  rm -rf "/tmp/kv-call/trace_$b"
  PDSERVE_TRACE="/tmp/kv-call/trace_$b" timeout -k 5 60 python3 benchmarks/bench_kv_transfer.py --backend "$b" \
    --out "$out/traced_$b.json" --tokens 4096 --send room --page-order contiguous --iters 12 > "$out/traced_$b.log" 2>&1
  python3 benchmarks/trace_report.py "/tmp/kv-call/trace_$b" --origin kv.send >> "$out/traced_$b.log" 2>&1
  echo "traced $b: exit $?" >> "$out/env.txt"
done
if [ -z "${KV_NO_TESTS:-}" ]; then  # KV_NO_TESTS=1: the benchmarks only
  timeout -k 5 140 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_kv_ipc.py tests/test_gpu_kv_nccl.py \
    tests/test_gpu_kv_nixl.py > "$out/tests.log" 2>&1
  echo "tests: exit $?" >> "$out/env.txt"
fi
grep -h "peer copy\|^ours\|^plain\|DIFFER" "$out"/bench_*.log
for b in cuda_ipc nccl nixl; do echo "== $b, traced"; grep -A14 "^ours\|ids timed" "$out/traced_$b.log" | grep -v "^peer"; done
[ -f "$out/tests.log" ] && tail -3 "$out/tests.log"; cat "$out/env.txt"
tar -C /tmp/kv-call -czf "${OUT:-/tmp/kv-call}/kv.tgz" kv
