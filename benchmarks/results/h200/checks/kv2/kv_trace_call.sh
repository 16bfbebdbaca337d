#!/bin/bash
# One device call on one GPU (nvidia-h200, carry .whl): a KV room's fixed cost with both ends on cuda:0 after the
# one-kernel copies (see README.md here). First the row-copy kernel on its own (probe_rows.py, which also brings the
# GPU and the host out of idle before anything is timed), then bench_kv_transfer --paired for cuda_ipc and nixl,
# traced (per-case medians of the traced points) and untraced, then the GPU tests of both transports.
# Logs in $OUT/kv2.tgz.
set -u
source <(sed -n '/^setup_env()/,/^}/p' benchmarks/gpu.sh)
setup_env > /dev/null
here=benchmarks/results/h200/checks/kv2
out=/tmp/kv2-call/kv2
mkdir -p "$out"
{ nvidia-smi -L; git log -1 --format='tree %h %s'; git status --short -- kv_transfer benchmarks tests;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } > "$out/env.txt" 2>&1
timeout -k 5 100 python3 $here/probe_rows.py > "$out/probe_rows.log" 2>&1
echo "probe_rows: exit $?" >> "$out/env.txt"
bench() {  # backend, traced (1/0)
  local b=$1 name=$([ "$2" = 1 ] && echo traced || echo plain)
  [ "$2" = 1 ] && rm -rf "/tmp/kv2-call/trace_$b"
  PDSERVE_TRACE=$([ "$2" = 1 ] && echo "/tmp/kv2-call/trace_$b") timeout -k 5 120 python3 \
    benchmarks/bench_kv_transfer.py --backend "$b" --prefill-device cuda:0 --decode-device cuda:0 \
    --out "$out/${name}_$b.json" --tokens 4096 16384 --send room --page-order contiguous shuffled --warmup 5 \
    --iters 12 --paired > "$out/${name}_$b.log" 2>&1
  echo "$name $b: exit $?" >> "$out/env.txt"
}
for b in cuda_ipc nixl; do
  bench $b 1
  python3 benchmarks/trace_report.py "/tmp/kv2-call/trace_$b" --origin kv.send >> "$out/traced_$b.log" 2>&1
  python3 $here/kv_cases.py "/tmp/kv2-call/trace_$b" "$out/traced_$b.json" > "$out/cases_$b.txt" 2>&1
  bench $b 0
done
timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider -rfEs --durations=6 tests/test_gpu_kv_ipc.py \
  tests/test_gpu_kv_nixl.py > "$out/gpu_tests.log" 2>&1
echo "gpu tests: exit $?" >> "$out/env.txt"
for b in cuda_ipc nixl; do echo "== $b"; grep -h "^ours\|ROWS" "$out/traced_$b.log" "$out/plain_$b.log"; cat "$out/cases_$b.txt"; done
cat "$out/probe_rows.log"; tail -12 "$out/gpu_tests.log"; cat "$out/env.txt"
tar -C /tmp/kv2-call -czf "${OUT:-/tmp/kv2-call}/kv2.tgz" kv2 trace_cuda_ipc trace_nixl
