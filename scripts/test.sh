#!/usr/bin/env bash
# The test command named in the README: the CPU suite (GPU-marked tests skip themselves without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -q "$@"
