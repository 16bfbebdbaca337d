#!/usr/bin/env bash
# Installs pdserve and, unless told otherwise, what its tests need. Idempotent: a second run installs nothing new.
#
#   scripts/setup.sh              pdserve + the test extras (scripts/test.sh), and Debian's redis-server and
#                                 prometheus for the tests that use them (asks apt only when run as root)
#   scripts/setup.sh --runtime    pdserve alone: what scripts/demo.sh runs (no test extras, no Debian packages)
#   scripts/setup.sh --no-apt     never install Debian packages (PDSERVE_NO_APT=1 does the same)
set -euo pipefail
cd "$(dirname "$0")/.."
runtime=0
apt=${PDSERVE_NO_APT:+0}
apt=${apt:-1}
for arg in "$@"; do
  case "$arg" in
    --runtime) runtime=1; apt=0 ;;
    --no-apt) apt=0 ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "setup: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done
say() { echo "[setup] $*" >&2; }
# The CPU build of torch (a local wheel on our machines; pip fetches it elsewhere) before anything that needs torch,
# so that no package pulls a multi-GB CUDA build instead. The same version as deploy/docker/Dockerfile.cpu; the GPU
# build (torch 2.11 + CUDA 13) is the README's GPU install and Dockerfile.cuda's (tests/test_packaging.py checks).
TORCH_CPU_VERSION=2.13.0
if ! python3 -c "import torch" 2>/dev/null; then
  say "installing torch $TORCH_CPU_VERSION (the CPU build, about 200 MB; a minute or two) ..."
  python3 -m pip install -q "torch==$TORCH_CPU_VERSION" ||
    python3 -m pip install -q "torch==$TORCH_CPU_VERSION" --index-url https://download.pytorch.org/whl/cpu
fi
if [ "$runtime" = 1 ]; then
  say "installing pdserve and its runtime dependencies (grpcio, tokenizers, safetensors, aiohttp, ...) ..."
  python3 -m pip install -q -e .
  say "done"
  exit 0
fi
say "installing pdserve with its test extras (pytest, transformers, openai, triton for the interpreter tests, ...) ..."
python3 -m pip install -q -e ".[test]"
# Debian's redis-server (routing tests) and prometheus (the monitoring test scrapes a running stack with it; promtool
# checks deploy/prometheus); without them those tests skip themselves.
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$apt" = 0 ]; then
    say "not installing ${missing[*]} (--no-apt); their tests will be skipped"
  elif [ "$(id -u)" = 0 ]; then
    say "installing the Debian packages ${missing[*]} with apt-get, as root (skip with --no-apt) ..."
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null) || say "could not install ${missing[*]}; their tests will be skipped"
  else
    say "${missing[*]} not installed (sudo apt-get install ${missing[*]}); their tests will be skipped"
  fi
fi
say "done"
