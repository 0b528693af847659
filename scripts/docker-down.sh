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

step() { echo "docker-down: $*"; }

stop() { # NAME PIDFILE
  local name=$1 pidfile=$2 pid
  if [[ ! -f $pidfile ]]; then
    step "$name: no $pidfile, nothing to stop"
    return
  fi
  pid=$(<"$pidfile")
  if ! kill -0 "$pid" 2>/dev/null; then
    step "$name: pid $pid not running"
    rm -f "$pidfile"
    return
  fi
  kill -TERM "$pid"
  local deadline=$((SECONDS + TIMEOUT_S))
  while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
      step "$name: pid $pid still alive after ${TIMEOUT_S}s, sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      sleep 0.5
      break
    fi
    sleep 0.2
  done
  rm -f "$pidfile"
  step "$name: stopped pid $pid"
}

# Registry first: it does not depend on the engine, and dockerd may take a while to stop containers.
stop docker-registry "$STATE_DIR/registry.pid"
stop dockerd "$STATE_DIR/dockerd.pid"
