# Sourced at the start of every command on the GPU machine: the wheels it lacks (carried in .whl, see
# ../shared/tools/gpu-wheels.sh) and a FlashInfer JIT cache inside the run.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer}
mkdir -p "${OUT:-/tmp/out}"
