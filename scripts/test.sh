#!/usr/bin/env bash
# The test command named in the README: the CPU suite (GPU-marked tests skip themselves without a GPU).
# The Triton kernels' CPU-interpreter tests run in their own pytest process with TRITON_INTERPRET=1 set before
# anything imports triton: triton fixes interpreted-or-compiled at its first import.
set -uo pipefail
cd "$(dirname "$0")/.."
interp=(tests/test_triton_attention_interpret.py tests/test_triton_moe_gemm_interpret.py tests/test_triton_norm_rope_interpret.py)
ignore=()
for f in "${interp[@]}"; do ignore+=(--ignore="$f"); done
python3 -m pytest -q "${ignore[@]}" "$@"
main=$?
TRITON_INTERPRET=1 python3 -m pytest -q "${interp[@]}"
kernels=$?
exit $(( main != 0 ? main : kernels ))
