#!/bin/bash
# One device call on one GPU (nvidia-h200, carry .whl): where a room's fixed cost goes, both ends on cuda:0.
# A 4k-token room of 61 V3 layers is ~275 MiB, which the device copies in ~0.14 ms, so on one GPU a transfer's
# time is almost all its fixed cost (what keeps 4k rooms under half a peer copy on two GPUs). cuda_ipc and nixl
# (nccl refuses two ranks on one GPU), whole rooms, traced (PDSERVE_TRACE kv.* marks, trace_report --origin kv.send).
# Logs in $OUT/kv1.tgz.
set -u
source <(sed -n '/^setup_env()/,/^}/p' benchmarks/gpu.sh)
setup_env > /dev/null
out=/tmp/kv1-call/kv1
mkdir -p "$out"
{ nvidia-smi -L; git log -1 --format='tree %h %s'; git status --short -- kv_transfer benchmarks; } > "$out/env.txt" 2>&1
for b in cuda_ipc nixl; do
  rm -rf "/tmp/kv1-call/trace_$b"
  PDSERVE_TRACE="/tmp/kv1-call/trace_$b" timeout -k 5 90 python3 benchmarks/bench_kv_transfer.py --backend "$b" \
    --prefill-device cuda:0 --decode-device cuda:0 --out "$out/traced_$b.json" --tokens 4096 16384 --send room \
    --page-order contiguous shuffled --iters 12 --paired ${KV_PROFILE:+--profile} > "$out/traced_$b.log" 2>&1
  echo "traced $b: exit $?" >> "$out/env.txt"
  python3 benchmarks/trace_report.py "/tmp/kv1-call/trace_$b" --origin kv.send >> "$out/traced_$b.log" 2>&1
done
for b in cuda_ipc nixl; do echo "== $b"; grep -v "^\[W\|^wrote" "$out/traced_$b.log" | tail -40; done
cat "$out/env.txt"
tar -C /tmp/kv1-call -czf "${OUT:-/tmp/kv1-call}/kv1.tgz" kv1 trace_cuda_ipc trace_nixl
# The send's host pieces one by one (no transport): where kv.send -> kv.send_returned goes.
[ -n "${KV_PROBE:-}" ] && PDSERVE_TRACE=/tmp/kv1-call/probe python3 benchmarks/results/h200/checks/probe_send.py
