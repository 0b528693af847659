#!/usr/bin/env bash
# Stop what scripts/labserver-up.sh STATE_DIR started: the mlflow server (its whole process group,
# by STATE_DIR/mlflow.pid), then PostgreSQL (pg_ctl stop on STATE_DIR/pg/data). Data stays in STATE_DIR.
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 STATE_DIR" >&2
  exit 2
fi
STATE_DIR=$1
TIMEOUT_S=${LABSERVER_DOWN_TIMEOUT_S:-30}
PG_BIN=/usr/lib/postgresql/15/bin

TAG=labserver-down
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"

pidfile=$STATE_DIR/mlflow.pid
if [[ -f $pidfile ]] && kill -0 "$(<"$pidfile")" 2>/dev/null; then
  pid=$(<"$pidfile")
  # setsid made it a group leader: its workers share its process group id.
  kill -TERM -- "-$pid" 2>/dev/null || true
  deadline=$((SECONDS + TIMEOUT_S))
  while kill -0 -- "-$pid" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
      step "mlflow server group $pid still alive after ${TIMEOUT_S}s, sending SIGKILL"
      kill -KILL -- "-$pid" 2>/dev/null || true
      break
    fi
    sleep 0.1
  done
  step "mlflow server: stopped process group $pid"
else
  step "mlflow server: not running"
fi
rm -f "$pidfile"

if [[ -f $STATE_DIR/pg/data/postmaster.pid ]]; then
  runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$STATE_DIR/pg/data" -m fast -w -t "$TIMEOUT_S" stop >/dev/null \
    || die "pg_ctl stop failed for $STATE_DIR/pg/data"
  step "postgres: stopped"
else
  step "postgres: not running"
fi
rm -f "$STATE_DIR/postgres.pid"
