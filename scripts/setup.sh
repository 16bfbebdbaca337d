#!/usr/bin/env bash
# Installs pdserve and what its tests need. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CPU build of torch (a local wheel on our machines; pip fetches it elsewhere) before anything that needs torch,
# so that no package pulls a multi-GB CUDA build instead.
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.13.0" \
  || python3 -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
python3 -m pip install -q -e ".[test]"
# A real redis-server for the routing tests (Debian's package); without it those tests skip themselves.
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
      || echo "setup: could not install redis-server; Redis tests will be skipped" >&2
  else
    echo "setup: redis-server is not installed (sudo apt-get install redis-server); Redis tests will be skipped" >&2
  fi
fi
