#!/bin/sh
# Entrypoint of the pdserve images: `docker run IMAGE router|prefill|decode|up|healthcheck|...` runs `pdserve ROLE`,
# configured by flags and PDSERVE_* variables (README: "Operating pdserve").
set -eu

# The models volume and the demo checkpoint the images carry (models/tiny-trained, copied in by the Dockerfiles).
# Both are overridable only so that tests can run this script against temporary directories.
MODELS_VOLUME=${MODELS_VOLUME:-/models}
BUNDLED_MODEL=${BUNDLED_MODEL:-/opt/pdserve/models/tiny-trained}
if [ "${1:-}" = "init-model" ]; then
  # docker-compose's one-shot service: puts the demo model into the models volume when it is the model asked for and
  # is not there yet. A checkpoint that is there (config.json) is never overwritten, nor is any other model touched.
  model=${PDSERVE_MODEL:-$MODELS_VOLUME/tiny-trained}
  if [ -f "$model/config.json" ]; then
    exit 0
  fi
  case $model in
    "$MODELS_VOLUME/tiny-trained")
      # The trained demo model (the default): a copy of the bundled one, made under another name and renamed, so a
      # copy cut short is never taken for a checkpoint. `mv -T` fills an empty directory (a fresh mount point) but
      # fails on a non-empty one rather than overwrite or nest into it.
      rm -rf "$model.partial"
      cp -R "$BUNDLED_MODEL" "$model.partial"
      mv -T "$model.partial" "$model"
      ;;
    "$MODELS_VOLUME/tiny-deepseek-v3")
      # Only when asked for by name: the random-weights tiny model of earlier releases (a few seconds to make).
      exec pdserve make-tiny-model "$model"
      ;;
  esac
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
