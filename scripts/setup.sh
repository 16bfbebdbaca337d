#!/usr/bin/env bash
# Installs pdserve and what its tests need. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CPU build of torch (a local wheel on our machines; pip fetches it elsewhere) before anything that needs torch,
# so that no package pulls a multi-GB CUDA build instead.
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.13.0" \
  || python3 -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
python3 -m pip install -q -e ".[test]"
