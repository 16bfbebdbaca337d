#!/usr/bin/env bash
# The README's main command: installs pdserve if needed (its runtime dependencies only), then runs the whole stack
# locally (router + 1 prefill + 1 decode worker) on the bundled demo model, models/tiny-trained (trained by
# scripts/train_tiny.py, committed): gRPC on :50051, the OpenAI HTTP API on :8000, metrics on :9100-9102.
# Extra flags go to `pdserve up`, e.g. --speculative-algorithm NEXTN or --no-http.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import pdserve.cli, torch, grpc, safetensors, tokenizers, aiohttp, jinja2" 2>/dev/null \
  || scripts/setup.sh --runtime
exec python3 -m pdserve up "$@"
