# Shared by the bring-up scripts (docker-*, hosts-*, slurm-*). Source it after setting TAG, the
# script's name in its messages.

step() { echo "$TAG: $*"; }
die() { echo "$TAG: error: $*" >&2; exit 1; }

# last_lines FILE [N]: its last N (5) lines on one line, for an error message.
last_lines() { tail -n "${2:-5}" "$1" 2>/dev/null | tr '\n' ' '; }

# alive PIDFILE: the process it names runs. A pidfile only these scripts write: a daemon that
# writes its own truncates it first, and a reader in that instant would see an empty file.
alive() {
  local pid
  pid=$(cat "$1" 2>/dev/null) && [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

# state_dir ARGS...: the script's one argument, STATE_DIR, created; printed as an absolute path.
state_dir() {
  if [[ $# -ne 1 ]]; then
    echo "usage: $0 STATE_DIR" >&2
    exit 2
  fi
  mkdir -p "$1" && cd "$1" && pwd
}

# install_missing LOG PACKAGE...: apt-get install them; the package lists are refreshed only when
# installing from the current ones fails (a fresh machine has none).
install_missing() {
  local log=$1
  shift
  export DEBIAN_FRONTEND=noninteractive
  local -a install=(apt-get install -y --no-install-recommends "$@")
  if ! "${install[@]}" >"$log" 2>&1; then
    step "apt-get update (package lists missing or stale)"
    apt-get update >>"$log" 2>&1 || die "apt-get update failed, see $log"
    "${install[@]}" >>"$log" 2>&1 || die "apt-get install $* failed, see $log"
  fi
  step "installed $*"
}

# stop_pidfiles TIMEOUT_S NAME:PIDFILE...: SIGTERM every daemon named by a pidfile at once (never a
# process found by name), wait for each, SIGKILL what is left after TIMEOUT_S; removes the pidfiles.
stop_pidfiles() {
  local timeout_s=$1 entry name pidfile pid
  shift
  local -a names=() pids=() pidfiles=()
  for entry in "$@"; do
    name=${entry%%:*} pidfile=${entry#*:}
    if [[ ! -f $pidfile ]]; then
      step "$name: no $pidfile, nothing to stop"
      continue
    fi
    pid=$(<"$pidfile")
    if ! kill -0 "$pid" 2>/dev/null; then
      step "$name: pid $pid not running"
      rm -f "$pidfile"
      continue
    fi
    kill -TERM "$pid"
    names+=("$name") pids+=("$pid") pidfiles+=("$pidfile")
  done
  local deadline=$((SECONDS + timeout_s)) i
  for i in "${!pids[@]}"; do
    while kill -0 "${pids[i]}" 2>/dev/null; do
      if ((SECONDS >= deadline)); then
        step "${names[i]}: pid ${pids[i]} still alive after ${timeout_s}s, sending SIGKILL"
        kill -KILL "${pids[i]}" 2>/dev/null || true
        sleep 0.5
        break
      fi
      sleep 0.1
    done
    rm -f "${pidfiles[i]}"
    step "${names[i]}: stopped pid ${pids[i]}"
  done
}
