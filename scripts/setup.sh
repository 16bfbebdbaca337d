#!/usr/bin/env bash
# Installs pdserve and what its tests need. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CPU build of torch (a local wheel on our machines; pip fetches it elsewhere) before anything that needs torch,
# so that no package pulls a multi-GB CUDA build instead.
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.13.0" \
  || python3 -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
python3 -m pip install -q -e ".[test]"
# Debian's redis-server (routing tests) and prometheus (the monitoring test scrapes a running stack with it; promtool
# checks deploy/prometheus); without them those tests skip themselves.
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null) || echo "setup: could not install ${missing[*]}; their tests will be skipped" >&2
  else
    echo "setup: ${missing[*]} not installed (sudo apt-get install ${missing[*]}); their tests will be skipped" >&2
  fi
fi
