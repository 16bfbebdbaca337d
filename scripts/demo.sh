#!/usr/bin/env bash
# The README's main command: installs pdserve if needed, then runs the whole stack locally (router + 1 prefill +
# 1 decode worker) on the bundled tiny model, made on first run in models/. Extra flags go to `pdserve up`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import pdserve.cli, torch, grpc, safetensors, tokenizers" 2>/dev/null || scripts/setup.sh
exec python3 -m pdserve up "$@"
