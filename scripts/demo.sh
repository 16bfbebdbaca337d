#!/usr/bin/env bash
# The README's main command: installs pdserve if needed, makes the bundled tiny model on first run, and runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import pdserve.cli, torch, safetensors, tokenizers" 2>/dev/null || scripts/setup.sh
MODEL=${PDSERVE_MODEL:-models/tiny-deepseek-v3}
[ -f "$MODEL/config.json" ] || python3 -m pdserve make-tiny-model "$MODEL"
python3 -m pdserve generate --model "$MODEL" --prompt "${1:-The router sends each request to}" --max-new-tokens 24
