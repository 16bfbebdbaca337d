#!/usr/bin/env bash
# Regenerates pdserve/v1/*_pb2*.py from protos/pdserve/v1/*.proto. The generated files are committed, so running
# pdserve needs no code generation. Usage: scripts/gen_protos.sh [OUT_DIR]   (default: the repository root)
#
# NOTE: generated with grpcio-tools 1.66.2 (protobuf gencode 5.27) on purpose: generated code demands a grpcio and
# protobuf runtime at least as new as its generator, and the GPU machines run grpcio 1.84. Newer runtimes accept
# older gencode, so this keeps every machine working.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
tools=.cache/grpcio-tools-1.66.2
[ -d "$tools/grpc_tools" ] || python3 -m pip install -q --target "$tools" grpcio-tools==1.66.2
PYTHONPATH="$tools" python3 -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" protos/pdserve/v1/*.proto
