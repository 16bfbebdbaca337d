#!/bin/sh
# Entrypoint of the pdserve images: `docker run IMAGE router|prefill|decode|up|healthcheck|...` runs `pdserve ROLE`,
# configured by flags and PDSERVE_* variables (README: "Operating pdserve").
set -eu

TINY_MODEL=/models/tiny-deepseek-v3
if [ "${1:-}" = "init-model" ]; then
  # docker-compose's one-shot service: the bundled tiny model (random weights, a few seconds) is made once into the
  # models volume when it is the model asked for and is not there yet. A real checkpoint is never overwritten.
  if [ "${PDSERVE_MODEL:-$TINY_MODEL}" = "$TINY_MODEL" ] && [ ! -f "$TINY_MODEL/config.json" ]; then
    exec pdserve make-tiny-model "$TINY_MODEL"
  fi
  exit 0
fi

# Peers dial a worker at the address it registers in Redis, and a prefill worker sends KV to the endpoint a decode
# worker reports; both default to this container's own IP (Kubernetes sets them to the pod IP instead).
# NOTE: the decode KV listener binds to PDSERVE_KV_HOST and reports that same address, so it must be an address
# peers can reach, never 0.0.0.0.
if [ -z "${PDSERVE_ADVERTISE_HOST:-}" ]; then
  PDSERVE_ADVERTISE_HOST=$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')
  export PDSERVE_ADVERTISE_HOST
fi
export PDSERVE_KV_HOST="${PDSERVE_KV_HOST:-$PDSERVE_ADVERTISE_HOST}"
exec pdserve "$@"
