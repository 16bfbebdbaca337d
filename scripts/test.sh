#!/usr/bin/env bash
# The test command named in the README: the CPU suite (GPU-marked tests skip themselves without a GPU).
# The Triton kernels' CPU-interpreter tests run in their own pytest process with TRITON_INTERPRET=1 set before
# anything imports triton: triton fixes interpreted-or-compiled at its first import.
# The main suite runs in two pytest processes (pytest-xdist, a module's tests in one process, so that its fixtures
# start once): most of its time is spent waiting on the worker processes and stacks its tests start, and one
# process left about one of two cores idle. The interpreter process is a minute of work for one core: it runs
# beside them at the lowest priority, taking only cycles they leave idle. Its report follows.
set -uo pipefail
cd "$(dirname "$0")/.."
# The test extras, installed once (find_spec: no import, so no cost on later runs).
python3 -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
  ('pytest', 'xdist', 'openai', 'transformers', 'matplotlib', 'pdserve')))" 2>/dev/null || scripts/setup.sh
interp=(tests/test_triton_attention_interpret.py tests/test_triton_moe_gemm_interpret.py tests/test_triton_norm_rope_interpret.py)
ignore=()
for f in "${interp[@]}"; do ignore+=(--ignore="$f"); done
interp_log=$(mktemp)
interp_pid=
trap '[ -n "$interp_pid" ] && kill "$interp_pid" 2>/dev/null; rm -f "$interp_log"' EXIT
trap 'exit 130' INT TERM
# -p no:cacheprovider: the two processes would both write .pytest_cache at the end.
TRITON_INTERPRET=1 nice -n 19 python3 -m pytest -q -p no:cacheprovider "${interp[@]}" >"$interp_log" 2>&1 &
interp_pid=$!
python3 -m pytest -q -n 2 --dist loadfile "${ignore[@]}" "$@"
main=$?
wait "$interp_pid"
kernels=$?
interp_pid=
echo "---- Triton interpreter tests (TRITON_INTERPRET=1) ----"
cat "$interp_log"
exit $(( main != 0 ? main : kernels ))
