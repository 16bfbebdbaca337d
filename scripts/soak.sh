#!/usr/bin/env bash
# Soak: `pdserve up` (2 prefill + 2 decode workers on the CPU, the demo model) on a Redis of its own with an
# internal token, under steady load from `pdserve bench`, while what broke such a stack before arrives:
#   - a decode worker that cannot pair with the others (--page-size 8) joins through Redis,
#   - a malformed worker registration and malformed / unsigned prefix-ownership entries are written into Redis,
#   - a prompt of 16 million token ids comes in over gRPC.
# Passes (exit 0, "SOAK PASSED") when no healthy request failed or hung, the incompatible worker got no request, the
# 16M-id prompt was refused with INVALID_ARGUMENT, and every worker's KV pool is idle at the end. Prints each event,
# the bench report and each check.
#
#   scripts/soak.sh [SECONDS=40] [MODEL_DIR=models/tiny-trained]
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-40}
MODEL=${2:-models/tiny-trained}
RATE=${SOAK_RATE:-4}  # requests per second (Poisson), at most SOAK_CONCURRENCY in flight
CONCURRENCY=${SOAK_CONCURRENCY:-16}
TOKEN=soak-internal-token
LOGS=$(mktemp -d /tmp/pdserve-soak.XXXXXX)
command -v redis-server >/dev/null || { echo "soak: needs redis-server (scripts/setup.sh installs it)" >&2; exit 2; }

say() { echo "[soak +$((SECONDS - T0))s] $*"; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PIDS=()
cleanup() {  # SIGTERM to what this script started (each drains), then wait for it
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
T0=$SECONDS

REDIS_PORT=$(free_port)
REDIS_URL=redis://127.0.0.1:$REDIS_PORT
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no >"$LOGS/redis.log" 2>&1 &
PIDS+=($!)
ROUTER_PORT=$(free_port)
say "logs in $LOGS; pdserve up: 2 prefill + 2 decode workers on $MODEL, Redis on :$REDIS_PORT, an internal token"
PDSERVE_INTERNAL_TOKEN=$TOKEN python3 -m pdserve up --model "$MODEL" --prefill 2 --decode 2 --redis-url "$REDIS_URL" \
  --port "$ROUTER_PORT" --metrics-port 0 --no-http >"$LOGS/up.log" 2>&1 &
UP=$!
PIDS+=($UP)
until grep -q "pdserve is up" "$LOGS/up.log"; do
  kill -0 "$UP" 2>/dev/null || { cat "$LOGS/up.log"; echo "soak: pdserve up exited" >&2; exit 1; }
  [ $((SECONDS - T0)) -lt 300 ] || { cat "$LOGS/up.log"; echo "soak: pdserve up not up in 300 s" >&2; exit 1; }
  sleep 0.5
done
ROUTER_METRICS=$(grep -o 'router metrics .*http://[0-9.]*:[0-9]*' "$LOGS/up.log" | grep -o '[0-9]*$')
say "up: router gRPC on :$ROUTER_PORT, its metrics on :$ROUTER_METRICS"

NUM=$((RATE * DURATION))
say "bench: $NUM requests at $RATE/s (at most $CONCURRENCY in flight), ~${DURATION}s"
python3 -m pdserve bench --target "127.0.0.1:$ROUTER_PORT" --num-prompts "$NUM" --request-rate "$RATE" \
  --max-concurrency "$CONCURRENCY" --input-len 64 --output-len 32 --range-ratio 0.5 \
  --shared-prefix-groups 4 --shared-prefix-len 32 --request-timeout 60 --no-progress \
  --json "$LOGS/bench.json" >"$LOGS/bench.txt" 2>&1 &
BENCH=$!
PIDS+=($BENCH)
# Each event must come while the load still runs (the checks read what the stack did with requests after it): on a
# machine slower than this soak's length allows, say so rather than pass checks the load never reached.
under_load() {
  kill -0 "$BENCH" 2>/dev/null || {
    echo "soak: the load ended before $1: this machine needs a longer soak than ${DURATION} s" \
      "(scripts/soak.sh SECONDS)" >&2
    exit 1
  }
}

BAD_PORT=$(free_port) BAD_METRICS=$(free_port)
say "an incompatible decode worker starts: pdserve decode --page-size 8 --port $BAD_PORT --redis-url ..."
PDSERVE_INTERNAL_TOKEN=$TOKEN python3 -m pdserve decode --model "$MODEL" --page-size 8 --redis-url "$REDIS_URL" \
  --port "$BAD_PORT" --metrics-port "$BAD_METRICS" --worker-id soak-page-size-8 --skip-warmup \
  >"$LOGS/decode-page-size-8.log" 2>&1 &
PIDS+=($!)
# It loads its model meanwhile (no warm-up: it is never meant to serve), then joins the live stack by registering.
python3 - "$REDIS_URL" "$DURATION" <<'EOF'
import sys
import time

import redis

r, t0 = redis.Redis.from_url(sys.argv[1]), time.monotonic()
while not r.exists("pdserve:worker:decode:soak-page-size-8"):
    if time.monotonic() - t0 > float(sys.argv[2]):
        sys.exit(f"[soak] the incompatible decode worker did not register within {sys.argv[2]} s")
    time.sleep(0.2)
print(f"[soak] the incompatible decode worker joined (registered in Redis) {time.monotonic() - t0:.1f} s later")
EOF

sleep $((DURATION / 8))
under_load "the malformed registrations and ownership entries"
python3 - "$REDIS_URL" <<'EOF'
import sys

import redis

r = redis.Redis.from_url(sys.argv[1])
# A registration whose signature is a lone surrogate (its check raised on every refresh), and one that is not JSON.
r.set("pdserve:worker:decode:zz-surrogate", '{"worker_id": "zz", "role": "decode", "address": "127.0.0.1:1", '
      '"signed_at": 1e12, "signature": "\\udc80"}')
r.set("pdserve:worker:prefill:zz-garbage", b"\xff\xfe{not json")
# On every block some worker holds now (the bench's shared prefixes among them): bytes no worker writes, an unsigned
# owner and a made-up signature, naming a real worker.
blocks = list(r.scan_iter("pdserve:blk:*"))
owners = {m.split(b"|")[0] for key in blocks for m in r.smembers(key)}
worker = sorted(owners)[0] if owners else b"prefill-0"
for key in blocks:
    r.sadd(key, b"\xff\xfe", worker, worker + b"|" + b"0" * 64)
print(f"[soak] wrote a malformed registration of each role, and 3 malformed or unsigned owners (naming "
      f"{worker.decode()}) on each of {len(blocks)} blocks")
EOF

sleep $((DURATION / 8))
under_load "the 16M-id prompt"
say "a prompt of 16,000,000 token ids over gRPC"
BIG_OK=0
python3 - "127.0.0.1:$ROUTER_PORT" <<'EOF' || BIG_OK=$?
import sys
import time

import grpc

from pdserve.v1 import generate_pb2 as gen_pb

raw = gen_pb.GenerateRequest(tokenized=gen_pb.TokenizedInput(input_ids=[5] * 16_000_000)).SerializeToString()
with grpc.insecure_channel(sys.argv[1], options=[("grpc.max_send_message_length", 32 << 20)]) as ch:
    t0 = time.monotonic()
    try:
        list(ch.unary_stream("/pdserve.v1.Generation/Generate")(raw, timeout=60))
        status, details = "OK", ""
    except grpc.RpcError as e:
        status, details = e.code().name, e.details()
print(f"[soak] the 16M-id prompt: {status} in {time.monotonic() - t0:.2f} s: {details}")
sys.exit(0 if status == "INVALID_ARGUMENT" else 1)
EOF

wait "$BENCH" || true
say "bench done"
cat "$LOGS/bench.txt"

say "checks:"
set +e
python3 - "$LOGS" "$REDIS_URL" "$ROUTER_METRICS" "$BAD_METRICS" "$NUM" "$TOKEN" "$BIG_OK" <<'EOF'
import json
import sys
import time
import urllib.request

import grpc
import redis
from prometheus_client.parser import text_string_to_metric_families

from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

logs, redis_url, router_metrics, bad_metrics, num, token, big_ok = sys.argv[1:]
ok = True


def check(passed: bool, what: str) -> None:
    global ok
    ok &= passed
    print(f"  [{'ok' if passed else 'FAILED'}] {what}")


def metric(port: str, name: str, **labels) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                key = s.labels.get("reason", s.labels.get("outcome", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


result = json.load(open(f"{logs}/bench.json"))
check(result["completed"] == int(num) and result["failed"] == 0,
      f"healthy requests: {result['completed']} of {num} completed, {result['failed']} failed "
      f"{result['errors_by_status']}")
check(result["no_final_status"] == 0, f"hung (no final status): {result['no_final_status']}")
check(big_ok == "0", "the 16M-id prompt was refused with INVALID_ARGUMENT")
bad = metric(bad_metrics, "pdserve_requests_total")
check(sum(bad.values()) == 0, f"the incompatible decode worker got no request: {bad}")
up_log = open(f"{logs}/up.log").read()
check("is not routed to: it cannot pair" in up_log, "the router logged the incompatible worker as not routed to")
registrations = metric(router_metrics, "pdserve_worker_registrations_rejected_total")
check(registrations.get("malformed", 0) >= 2, f"malformed registrations skipped and counted: {registrations}")
owners = metric(router_metrics, "pdserve_prefix_ownership_rejected_total")
check(min(owners.get(k, 0) for k in ("malformed", "unsigned", "signature")) >= 1,
      f"malformed or unsigned ownership entries skipped and counted: {owners}")
check(up_log.count("Traceback") == 0, "no traceback in pdserve up's log")
r = redis.Redis.from_url(redis_url)
workers = [json.loads(r.get(k)) for k in r.scan_iter("pdserve:worker:*") if b"zz-" not in k]
check(len(workers) == 5, f"registered workers: {sorted(w['worker_id'] for w in workers)}")
for w in sorted(workers, key=lambda w: (w["role"], w["worker_id"])):
    stub = (pb_grpc.PrefillWorkerStub if w["role"] == "prefill" else pb_grpc.DecodeWorkerStub)
    with grpc.insecure_channel(w["address"]) as ch:
        deadline = time.monotonic() + 10
        while True:
            load = stub(ch).GetLoad(pb.GetLoadRequest(), timeout=5, metadata=(("authorization", f"Bearer {token}"),))
            idle = load.num_free_pages == load.num_total_pages and load.num_running_requests == 0 \
                and load.num_waiting_requests == 0 and load.num_transferring == 0
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    check(idle, f"{w['role']} {w['worker_id']}: free pages {load.num_free_pages}/{load.num_total_pages}, running "
          f"{load.num_running_requests}, waiting {load.num_waiting_requests}, transferring {load.num_transferring}")
print("SOAK PASSED" if ok else "SOAK FAILED")
sys.exit(0 if ok else 1)
EOF
