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

TAG=slurm-down
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"

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

# The nodes first, so slurmctld does not spend its shutdown on them; munged last with slurmctld.
stop_pidfiles "$TIMEOUT_S" "slurmd node1:$STATE_DIR/slurmd-node1.pid" "slurmd node2:$STATE_DIR/slurmd-node2.pid"
stop_pidfiles "$TIMEOUT_S" "slurmctld:$ctld_pidfile" "munged:$STATE_DIR/munged.pid"
bash "$HERE/hosts-down.sh" "$STATE_DIR/hosts"
