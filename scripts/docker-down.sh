#!/usr/bin/env bash
# Stop the dockerd and docker-registry that scripts/docker-up.sh STATE_DIR started, by their pidfiles.
# Engines or registries it reused (no pidfile in STATE_DIR) are left running.
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 STATE_DIR" >&2
  exit 2
fi
STATE_DIR=$1
TIMEOUT_S=${DOCKER_DOWN_TIMEOUT_S:-30}

TAG=docker-down
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"

# Registry first: it does not depend on the engine, and dockerd may take a while to stop containers.
stop_pidfiles "$TIMEOUT_S" "docker-registry:$STATE_DIR/registry.pid"
stop_pidfiles "$TIMEOUT_S" "dockerd:$STATE_DIR/dockerd.pid"
