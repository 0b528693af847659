#!/usr/bin/env bash
# Stop the cluster scripts/slurm-up.sh STATE_DIR started: cancel its jobs, stop slurmd, slurmctld and
# munged by the pidfiles in STATE_DIR (a munged it reused has none and is left running), then remove
# the namespace hosts (scripts/hosts-down.sh).
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 STATE_DIR" >&2
  exit 2
fi
STATE_DIR=$1
HERE=$(cd "$(dirname "$0")" && pwd)
TIMEOUT_S=${SLURM_DOWN_TIMEOUT_S:-30}
export SLURM_CONF=$STATE_DIR/slurm.conf

step() { echo "slurm-down: $*"; }

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

# Jobs first: their slurmstepd processes outlive slurmd and would keep the namespaces alive.
ctld_pidfile=$STATE_DIR/slurmctld.pid
if [[ -f $SLURM_CONF && -f $ctld_pidfile ]] && kill -0 "$(<"$ctld_pidfile")" 2>/dev/null; then
  jobs=$(timeout 10 squeue -h -o %i 2>/dev/null | tr '\n' ' ' || true)
  if [[ -n ${jobs// /} ]]; then
    step "cancelling jobs $jobs"
    timeout 10 scancel $jobs || true
    deadline=$((SECONDS + TIMEOUT_S))
    # KillWait=5 in slurm.conf: steps get SIGTERM, then SIGKILL 5 s later.
    while [[ -n $(timeout 10 squeue -h -o %i 2>/dev/null || true) ]]; do
      if ((SECONDS >= deadline)); then
        step "jobs still listed after ${TIMEOUT_S}s: $(timeout 10 squeue -h -o '%i=%T' | tr '\n' ' ')"
        break
      fi
      sleep 0.5
    done
  fi
fi

stop "slurmd node1" "$STATE_DIR/slurmd-node1.pid"
stop "slurmd node2" "$STATE_DIR/slurmd-node2.pid"
stop slurmctld "$ctld_pidfile"
stop munged "$STATE_DIR/munged.pid"
bash "$HERE/hosts-down.sh" "$STATE_DIR/hosts"
