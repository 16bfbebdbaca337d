#!/usr/bin/env bash
# Soak test (too long for CI): `pdserve bench` at high concurrency against router + 2 prefill + 2 decode workers on
# the CPU, with a decode worker and then a prefill worker SIGKILLed and restarted on the same port in the middle.
# Passes (exit 0) when every request ended with its tokens or a status (none without a final status) and every
# worker's KV pool is back to idle at the end. Prints the bench report and the pools.
#
#   scripts/soak.sh [SECONDS=120] [MODEL_DIR=models/tiny-deepseek-v3]
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-120}
MODEL=${2:-models/tiny-deepseek-v3}
RATE=${SOAK_RATE:-4}  # requests per second (Poisson), at most SOAK_CONCURRENCY in flight
CONCURRENCY=${SOAK_CONCURRENCY:-32}
LOGS=$(mktemp -d /tmp/pdserve-soak.XXXXXX)
[ -f "$MODEL/config.json" ] || python3 -m pdserve make-tiny-model "$MODEL" >/dev/null

say() { echo "[soak $(date +%T)] $*"; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
declare -A PID PORT
cleanup() { for name in "${!PID[@]}"; do kill "${PID[$name]}" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

start() {  # start NAME ROLE [PORT]: a worker (or the router) in the background, logging to $LOGS/NAME.log
  local name=$1 role=$2 port=${3:-$(free_port)} args=()
  if [ "$role" = router ]; then
    args=(--prefill "127.0.0.1:${PORT[prefill-0]}" --prefill "127.0.0.1:${PORT[prefill-1]}"
          --decode "127.0.0.1:${PORT[decode-0]}" --decode "127.0.0.1:${PORT[decode-1]}")
  else
    args=(--page-size 4 --num-pages 2048 --worker-id "$name")
  fi
  python3 -m pdserve "$role" --model "$MODEL" --port "$port" "${args[@]}" >>"$LOGS/$name.log" 2>&1 &
  PID[$name]=$! PORT[$name]=$port
}

wait_serving() {  # wait_serving NAME...
  python3 - "$@" <<EOF
import sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
ports = {$(for n in "$@"; do printf '"%s": %s, ' "$n" "${PORT[$n]}"; done)}
deadline = time.monotonic() + 120
for name in sys.argv[1:]:
    with grpc.insecure_channel(f"127.0.0.1:{ports[name]}") as ch:
        while True:
            try:
                if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    break
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"{name} did not start; see its log")
            time.sleep(0.2)
EOF
}

kill_and_restart() {  # kill_and_restart NAME ROLE: SIGKILL, wait a moment, start again on the same port
  local name=$1 role=$2
  say "SIGKILL $name (pid ${PID[$name]}, port ${PORT[$name]})"
  kill -9 "${PID[$name]}"
  sleep 3
  start "$name" "$role" "${PORT[$name]}"
  wait_serving "$name"
  say "$name restarted on port ${PORT[$name]}"
}

say "logs in $LOGS; starting 2 prefill + 2 decode workers and the router"
for i in 0 1; do start "prefill-$i" prefill; start "decode-$i" decode; done
wait_serving prefill-0 prefill-1 decode-0 decode-1
start router router
wait_serving router
NUM=$((RATE * DURATION))
say "bench: $NUM requests at $RATE/s (at most $CONCURRENCY in flight), ~${DURATION}s"
python3 -m pdserve bench --target "127.0.0.1:${PORT[router]}" --num-prompts "$NUM" --request-rate "$RATE" \
  --max-concurrency "$CONCURRENCY" --input-len 128 --output-len 48 --range-ratio 0.25 \
  --shared-prefix-groups 4 --shared-prefix-len 32 --request-timeout 120 --no-progress \
  --json "$LOGS/bench.json" >"$LOGS/bench.txt" 2>&1 &
BENCH=$!
sleep $((DURATION / 3)); kill_and_restart decode-0 decode
sleep $((DURATION / 4)); kill_and_restart prefill-1 prefill
wait "$BENCH" || { cat "$LOGS/bench.txt"; exit 1; }
cat "$LOGS/bench.txt"

say "pools after the run:"
python3 - "$LOGS/bench.json" ${PORT[prefill-0]} ${PORT[prefill-1]} ${PORT[decode-0]} ${PORT[decode-1]} <<'EOF'
import json, sys, time, grpc
from pdserve.v1 import worker_pb2 as pb, worker_pb2_grpc as pb_grpc
result, ok = json.load(open(sys.argv[1])), True
for role, port in zip(["prefill", "prefill", "decode", "decode"], sys.argv[2:]):
    stub_cls = pb_grpc.PrefillWorkerStub if role == "prefill" else pb_grpc.DecodeWorkerStub
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        deadline = time.monotonic() + 10
        while True:
            load = stub_cls(ch).GetLoad(pb.GetLoadRequest(), timeout=5)
            idle = load.num_free_pages == load.num_total_pages and load.num_running_requests == 0 \
                and load.num_waiting_requests == 0 and load.num_transferring == 0
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    print(f"  {role:7} :{port}  free pages {load.num_free_pages}/{load.num_total_pages}, running "
          f"{load.num_running_requests}, waiting {load.num_waiting_requests}, transferring {load.num_transferring}"
          f"  -> {'idle' if idle else 'NOT IDLE'}")
    ok &= idle
print(f"requests: {result['completed']} completed, {result['failed']} failed {result['errors_by_status']}, "
      f"{result['no_final_status']} without a final status")
ok &= result["no_final_status"] == 0
print("SOAK PASSED" if ok else "SOAK FAILED")
sys.exit(0 if ok else 1)
EOF
