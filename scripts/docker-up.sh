#!/usr/bin/env bash
# Start a Docker engine and a local registry (127.0.0.1:5000) whose state lives in STATE_DIR.
# Idempotent: an engine or registry that already answers is reused and left alone.
# Used by .ci/run and the Docker test fixtures; scripts/docker-down.sh STATE_DIR stops what this started.
set -euo pipefail

TAG=docker-up
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
STATE_DIR=$(state_dir "$@")
REGISTRY_ADDR=127.0.0.1:5000
TIMEOUT_S=${DOCKER_UP_TIMEOUT_S:-60}

# --- packages --------------------------------------------------------------------------------
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v iptables >/dev/null || missing+=(iptables)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v docker-registry >/dev/null || missing+=(docker-registry)
if ((${#missing[@]})); then
  install_missing "$STATE_DIR/apt.log" "${missing[@]}"
else
  step "packages present (docker.io iptables debootstrap docker-registry)"
fi

# --- engine ----------------------------------------------------------------------------------
if docker version >/dev/null 2>&1; then
  step "engine already answers docker version; reusing it"
else
  step "starting dockerd (data root $STATE_DIR/data, log $STATE_DIR/dockerd.log)"
  # setsid: the daemon must outlive the shell or test process that started it.
  setsid dockerd \
    --data-root "$STATE_DIR/data" \
    --exec-root "$STATE_DIR/exec" \
    -p "$STATE_DIR/dockerd.pid" \
    -H unix:///var/run/docker.sock \
    >>"$STATE_DIR/dockerd.log" 2>&1 </dev/null &
  deadline=$((SECONDS + TIMEOUT_S))
  until docker version >/dev/null 2>&1; do
    if ! kill -0 $! 2>/dev/null; then
      die "dockerd exited during startup; last log lines: $(tail -n 3 "$STATE_DIR/dockerd.log" | tr '\n' ' ')"
    fi
    ((SECONDS < deadline)) || die "dockerd did not answer docker version within ${TIMEOUT_S}s, see $STATE_DIR/dockerd.log"
    sleep 0.2
  done
  step "engine up (pid $(cat "$STATE_DIR/dockerd.pid"))"
fi

# --- registry --------------------------------------------------------------------------------
registry_answers() { curl -fsS -o /dev/null --max-time 2 "http://$REGISTRY_ADDR/v2/" 2>/dev/null; }
if registry_answers; then
  step "registry already answers at $REGISTRY_ADDR; reusing it"
else
  mkdir -p "$STATE_DIR/registry"
  cat >"$STATE_DIR/registry.yml" <<YAML
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $STATE_DIR/registry
  delete:
    enabled: true
http:
  addr: $REGISTRY_ADDR
YAML
  step "starting docker-registry on $REGISTRY_ADDR (storage $STATE_DIR/registry, log $STATE_DIR/registry.log)"
  setsid docker-registry serve "$STATE_DIR/registry.yml" >>"$STATE_DIR/registry.log" 2>&1 </dev/null &
  echo $! >"$STATE_DIR/registry.pid"
  deadline=$((SECONDS + TIMEOUT_S))
  until registry_answers; do
    if ! kill -0 "$(cat "$STATE_DIR/registry.pid")" 2>/dev/null; then
      die "docker-registry exited during startup; last log lines: $(tail -n 3 "$STATE_DIR/registry.log" | tr '\n' ' ')"
    fi
    ((SECONDS < deadline)) || die "registry did not answer http://$REGISTRY_ADDR/v2/ within ${TIMEOUT_S}s, see $STATE_DIR/registry.log"
    sleep 0.2
  done
  step "registry up (pid $(cat "$STATE_DIR/registry.pid"))"
fi
