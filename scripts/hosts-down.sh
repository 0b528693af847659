#!/usr/bin/env bash
# Remove what scripts/hosts-up.sh made: namespaces hn1, hn2, hnsw and the root-side veth hbr-host.
# Processes still inside a namespace are listed, never killed: stop them first (slurm-down.sh does).
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 STATE_DIR" >&2
  exit 2
fi

TAG=hosts-down
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"

for ns in hn1 hn2 hnsw; do
  if [[ ! -e /run/netns/$ns ]]; then
    step "$ns: not present"
    continue
  fi
  pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
  # A namespace that still holds a process outlives `ip netns del` (with its interfaces).
  [[ -z $pids ]] || step "$ns: warning: processes still inside keep it alive: $pids"
  ip netns del "$ns"
  step "$ns: deleted"
done
# The kernel destroys a deleted namespace's interfaces (and their veth peers) asynchronously: wait,
# so that a hosts-up.sh right after this does not see links about to vanish.
TIMEOUT_S=${HOSTS_DOWN_TIMEOUT_S:-10}
deadline=$((SECONDS + TIMEOUT_S))
while ip link show hbr-host >/dev/null 2>&1; do
  if ((SECONDS >= deadline)); then
    # Left half-made (or hnsw is kept alive by a process): remove our end by hand.
    ip link del hbr-host
    step "hbr-host: deleted"
    break
  fi
  sleep 0.1
done
