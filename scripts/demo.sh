#!/usr/bin/env bash
# The README's main command: installs pdserve if needed, then runs the whole stack locally (router + 1 prefill +
# 1 decode worker) on the bundled demo model, models/tiny-trained (trained by scripts/train_tiny.py, committed).
# Extra flags go to `pdserve up`, e.g. --speculative-algorithm NEXTN.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import pdserve.cli, torch, grpc, safetensors, tokenizers" 2>/dev/null || scripts/setup.sh
exec python3 -m pdserve up "$@"
