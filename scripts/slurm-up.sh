#!/usr/bin/env bash
# Start a two-node Slurm cluster on this machine: slurmctld in the root namespace (198.51.100.254),
# slurmd node1 in namespace hn1 (198.51.100.1) and node2 in hn2 (198.51.100.2), partition debug.
# Config, state, spool, pid and log files all live in STATE_DIR; use it with
#   export SLURM_CONF=STATE_DIR/slurm.conf
# Idempotent: daemons whose pidfile in STATE_DIR names a live process are kept, a munged that
# already answers is reused. scripts/slurm-down.sh STATE_DIR stops what this started.
set -euo pipefail

TAG=slurm-up
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
STATE_DIR=$(state_dir "$@")
HERE=$(cd "$(dirname "$0")" && pwd)
TIMEOUT_S=${SLURM_UP_TIMEOUT_S:-60}
NODES=(node1 node2)
declare -A NETNS=([node1]=hn1 [node2]=hn2)
declare -A ADDR=([node1]=198.51.100.1 [node2]=198.51.100.2)
CTLD_ADDR=198.51.100.254 # the root namespace's end of the bridge (hosts-up.sh)
export SLURM_CONF=$STATE_DIR/slurm.conf


((EUID == 0)) || die "must run as root (network namespaces, slurmd and munged need it)"
command -v nsenter >/dev/null && command -v unshare >/dev/null || die "nsenter/unshare (util-linux) are not installed"

# --- packages --------------------------------------------------------------------------------
missing=()
command -v slurmctld >/dev/null && command -v slurmd >/dev/null || missing+=(slurm-wlm)
command -v munged >/dev/null || missing+=(munge)
if ((${#missing[@]})); then
  install_missing "$STATE_DIR/apt.log" "${missing[@]}"
else
  step "packages present (slurm-wlm munge)"
fi

# --- hosts -----------------------------------------------------------------------------------
bash "$HERE/hosts-up.sh" "$STATE_DIR/hosts"

# --- slurm.conf --------------------------------------------------------------------------------
# slurmctld drops to SlurmUser=slurm: its state dir and log must be the slurm user's, and every
# folder above STATE_DIR must let it through (pytest's tmp dirs are 0700: use a folder like /tmp/x).
mkdir -p "$STATE_DIR/ctld"
chown slurm:slurm "$STATE_DIR/ctld"
touch "$STATE_DIR/slurmctld.log"
chown slurm:slurm "$STATE_DIR/slurmctld.log"
runuser -u slurm -- test -w "$STATE_DIR/ctld" \
  || die "user slurm cannot write $STATE_DIR/ctld: a folder above it is closed to others; use a STATE_DIR such as /tmp/harness-slurm"

conf=$(
  cat <<CONF
# Written by scripts/slurm-up.sh: two nodes in network namespaces hn1/hn2, controller in the root one.
ClusterName=harness
SlurmctldHost=$(hostname -s)($CTLD_ADDR)
SlurmUser=slurm
AuthType=auth/munge
CryptoType=crypto/munge
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool-%n
SlurmctldPidFile=$STATE_DIR/ctld/slurmctld.pid
SlurmdPidFile=$STATE_DIR/spool-%n/slurmd.pid
SlurmctldLogFile=$STATE_DIR/slurmctld.log
SlurmdLogFile=$STATE_DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# A finished job stays visible to 'scontrol show job ID' for 10 minutes.
MinJobAge=600
KillWait=5
UnkillableStepTimeout=30
NodeName=node1 NodeAddr=${ADDR[node1]} NodeHostname=node1 CPUs=2 State=UNKNOWN
NodeName=node2 NodeAddr=${ADDR[node2]} NodeHostname=node2 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
CONF
)
if [[ -f $SLURM_CONF && $(<"$SLURM_CONF") == "$conf" ]]; then
  step "slurm.conf unchanged ($SLURM_CONF)"
else
  if alive "$STATE_DIR/slurmctld.pid"; then
    die "$SLURM_CONF differs from what this script writes while slurmctld runs: run scripts/slurm-down.sh $STATE_DIR first"
  fi
  printf '%s\n' "$conf" >"$SLURM_CONF"
  step "wrote $SLURM_CONF"
fi

# --- munge -----------------------------------------------------------------------------------
munge_answers() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if munge_answers; then
  step "munged already answers; reusing it"
else
  [[ -f /etc/munge/munge.key ]] || {
    step "creating /etc/munge/munge.key"
    mungekey --create --keyfile=/etc/munge/munge.key && chown munge:munge /etc/munge/munge.key
  }
  mkdir -p /run/munge "$STATE_DIR/munge"
  chown munge:munge /run/munge "$STATE_DIR/munge"
  chmod 0700 "$STATE_DIR/munge"
  step "starting munged (pidfile $STATE_DIR/munge/munged.pid, log $STATE_DIR/munge/munged.log)"
  # munged refuses to run as root. setpriv execs it as user munge (runuser would stay as its
  # parent) and -F keeps it in the foreground, so $! is munged itself.
  setsid setpriv --reuid=munge --regid=munge --init-groups munged -F \
    --pid-file="$STATE_DIR/munge/munged.pid" --log-file="$STATE_DIR/munge/munged.log" \
    >>"$STATE_DIR/munge/munged.out" 2>&1 </dev/null &
  pid=$!
  deadline=$((SECONDS + TIMEOUT_S))
  until munge_answers; do
    kill -0 $pid 2>/dev/null || die "munged exited during startup; last log lines: $(last_lines "$STATE_DIR/munge/munged.log") $(last_lines "$STATE_DIR/munge/munged.out")"
    ((SECONDS < deadline)) || die "munged did not answer within ${TIMEOUT_S}s, see $STATE_DIR/munge/munged.log"
    sleep 0.1
  done
  # Ours, outside the munge-only folder: slurm-down.sh stops munged only if this file exists.
  echo $pid >"$STATE_DIR/munged.pid"
  step "munged up (pid $(<"$STATE_DIR/munged.pid"))"
fi

# --- slurmctld -------------------------------------------------------------------------------
if alive "$STATE_DIR/slurmctld.pid"; then
  step "slurmctld already running (pid $(<"$STATE_DIR/slurmctld.pid"))"
else
  step "starting slurmctld (log $STATE_DIR/slurmctld.log)"
  # -D: in the foreground, so $! is its pid; setsid: it outlives the caller.
  setsid slurmctld -D >>"$STATE_DIR/slurmctld.out" 2>&1 </dev/null &
  pid=$!
  deadline=$((SECONDS + TIMEOUT_S))
  until scontrol ping 2>/dev/null | grep -q 'is UP'; do
    kill -0 $pid 2>/dev/null || die "slurmctld exited during startup; last log lines: $(last_lines "$STATE_DIR/slurmctld.log") $(last_lines "$STATE_DIR/slurmctld.out")"
    ((SECONDS < deadline)) || die "slurmctld did not answer scontrol ping within ${TIMEOUT_S}s; last log lines: $(last_lines "$STATE_DIR/slurmctld.log")"
    sleep 0.2
  done
  echo $pid >"$STATE_DIR/slurmctld.pid" # ours; slurmctld's own is in ctld/ (see alive in lib.sh)
  step "slurmctld up (pid $pid)"
fi

# --- slurmd, one per namespace -----------------------------------------------------------------
for node in "${NODES[@]}"; do
  pidfile=$STATE_DIR/slurmd-$node.pid
  if alive "$pidfile"; then
    step "slurmd $node already running (pid $(<"$pidfile"))"
    continue
  fi
  mkdir -p "$STATE_DIR/spool-$node"
  step "starting slurmd $node in namespace ${NETNS[$node]} (log $STATE_DIR/slurmd-$node.log)"
  # nsenter, not `ip netns exec`: that remounts /sys, and slurmd's cgroup code then fails.
  # unshare --uts: the node gets its own hostname without touching the machine's.
  setsid nsenter --net="/run/netns/${NETNS[$node]}" unshare --uts \
    sh -c "hostname $node; exec slurmd -D -N $node" >>"$STATE_DIR/slurmd-$node.out" 2>&1 </dev/null &
  echo $! >"$pidfile"
done

# --- wait for both nodes idle ------------------------------------------------------------------
deadline=$((SECONDS + TIMEOUT_S))
while :; do
  states=$(sinfo -h -N -o '%N=%t' 2>/dev/null | sort -u | tr '\n' ' ')
  [[ $states == "node1=idle node2=idle " ]] && break
  for node in "${NODES[@]}"; do
    alive "$STATE_DIR/slurmd-$node.pid" \
      || die "slurmd $node exited; last log lines: $(last_lines "$STATE_DIR/slurmd-$node.log") $(last_lines "$STATE_DIR/slurmd-$node.out")"
  done
  if ((SECONDS >= deadline)); then
    die "nodes not idle within ${TIMEOUT_S}s (sinfo: ${states:-no answer}); last log lines: slurmctld: $(last_lines "$STATE_DIR/slurmctld.log" 3) node1: $(last_lines "$STATE_DIR/slurmd-node1.log" 3) node2: $(last_lines "$STATE_DIR/slurmd-node2.log" 3)"
  fi
  sleep 0.2
done
step "up: node1 (hn1 ${ADDR[node1]}) and node2 (hn2 ${ADDR[node2]}) idle in partition debug"
echo "export SLURM_CONF=$SLURM_CONF"
