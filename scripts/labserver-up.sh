#!/usr/bin/env bash
# Start a lab tracking server on loopback: PostgreSQL 15 (the backend store) and
# `mlflow server --serve-artifacts` (artifacts under STATE_DIR/artifacts, served through the server).
# Clients only ever see http://127.0.0.1:PORT, written to STATE_DIR/uri; the database password lives
# in STATE_DIR/pg/password (0600) and reaches nothing but the server's command line.
# Ports: $LABSERVER_PORT (default 5055; not 5000, the local Docker registry's) and
# $LABSERVER_PG_PORT (default 15432). Idempotent: a database or server whose pidfile names a live
# process is kept. scripts/labserver-down.sh STATE_DIR stops what this started;
# `scripts/labserver-up.sh STATE_DIR` after stopping only the server (STATE_DIR/mlflow.pid) restarts it.
set -euo pipefail

TAG=labserver-up
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
STATE_DIR=$(state_dir "$@")
TIMEOUT_S=${LABSERVER_UP_TIMEOUT_S:-120}
PORT=${LABSERVER_PORT:-5055}
PG_PORT=${LABSERVER_PG_PORT:-15432}
PG_BIN=/usr/lib/postgresql/15/bin
DB=harness
ROLE=harness


((EUID == 0)) || die "must run as root (initdb and postgres run as user postgres)"
((PORT != 5000)) || die "port 5000 is the local Docker registry's; choose another LABSERVER_PORT"

# --- packages --------------------------------------------------------------------------------
if [[ -x $PG_BIN/initdb && -x $PG_BIN/pg_ctl ]] && id postgres >/dev/null 2>&1; then
  step "postgresql present"
else
  install_missing "$STATE_DIR/apt.log" postgresql
fi
if python3 -c 'import psycopg2' 2>/dev/null; then
  step "psycopg2 present"
else
  step "pip install psycopg2-binary"
  python3 -m pip install -q psycopg2-binary >>"$STATE_DIR/pip.log" 2>&1 || die "pip install psycopg2-binary failed, see $STATE_DIR/pip.log"
fi

# --- PostgreSQL --------------------------------------------------------------------------------
# Owned by postgres, which must be able to reach it: every folder above STATE_DIR must let it through.
PG=$STATE_DIR/pg
mkdir -p "$PG"
chown postgres:postgres "$PG"
chmod 0700 "$PG"
runuser -u postgres -- test -w "$PG" \
  || die "user postgres cannot write $PG: a folder above it is closed to others; use a STATE_DIR such as /tmp/harness-labserver"
if [[ ! -f $PG/password ]]; then
  # Hex only: it goes into a URI and a SQL literal without quoting.
  python3 -c 'import secrets; print(secrets.token_hex(16))' >"$PG/password"
  chmod 0600 "$PG/password"
fi
PASSWORD=$(<"$PG/password")
if [[ ! -f $PG/data/PG_VERSION ]]; then
  step "initdb $PG/data"
  runuser -u postgres -- "$PG_BIN/initdb" -D "$PG/data" -U postgres --auth=trust -E UTF8 >"$PG/initdb.log" 2>&1 \
    || die "initdb failed: $(last_lines "$PG/initdb.log")"
fi
pg_pid() { head -n1 "$PG/data/postmaster.pid" 2>/dev/null; }
if [[ -n $(pg_pid) ]] && kill -0 "$(pg_pid)" 2>/dev/null; then
  step "postgres already running (pid $(pg_pid))"
else
  step "starting postgres on 127.0.0.1:$PG_PORT (socket in $PG, log $PG/postgres.log)"
  # pg_ctl -w waits for it to accept connections, up to -t seconds.
  runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$PG/data" -l "$PG/postgres.log" -w -t "$TIMEOUT_S" \
    -o "-p $PG_PORT -c listen_addresses=127.0.0.1 -k $PG" start >"$PG/pg_ctl.log" 2>&1 \
    || die "postgres did not start: $(last_lines "$PG/postgres.log") $(last_lines "$PG/pg_ctl.log")"
fi
pg_pid >"$STATE_DIR/postgres.pid"
psql_() { runuser -u postgres -- timeout 30 psql -h "$PG" -p "$PG_PORT" -U postgres -v ON_ERROR_STOP=1 -qtAX "$@"; }
if [[ $(psql_ -c "SELECT 1 FROM pg_roles WHERE rolname='$ROLE'") != 1 ]]; then
  psql_ -c "CREATE ROLE $ROLE LOGIN PASSWORD '$PASSWORD'"
fi
if [[ $(psql_ -c "SELECT 1 FROM pg_database WHERE datname='$DB'") != 1 ]]; then
  psql_ -c "CREATE DATABASE $DB OWNER $ROLE"
  step "created role and database $DB"
fi

# --- mlflow server -----------------------------------------------------------------------------
URI=http://127.0.0.1:$PORT
health() { python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2).read()' "$URI/health" 2>/dev/null; }
mkdir -p "$STATE_DIR/artifacts"
if alive "$STATE_DIR/mlflow.pid"; then
  step "mlflow server already running (pid $(<"$STATE_DIR/mlflow.pid"))"
else
  health && die "something else already answers on $URI; choose another LABSERVER_PORT"
  step "starting mlflow server on $URI (log $STATE_DIR/mlflow.log)"
  # --workers 1 and no job runner: up in ~8 s with 2 processes instead of ~31 s with 12.
  # setsid: its own process group, which labserver-down.sh signals as a whole (gunicorn/uvicorn workers).
  # The password is only in this command line and the server's environment, never in what clients see.
  MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid python3 -m mlflow server \
    --backend-store-uri "postgresql+psycopg2://$ROLE:$PASSWORD@127.0.0.1:$PG_PORT/$DB" \
    --artifacts-destination "$STATE_DIR/artifacts" --serve-artifacts \
    --host 127.0.0.1 --port "$PORT" --workers 1 \
    >>"$STATE_DIR/mlflow.log" 2>&1 </dev/null &
  echo $! >"$STATE_DIR/mlflow.pid"
fi
deadline=$((SECONDS + TIMEOUT_S))
until health; do
  alive "$STATE_DIR/mlflow.pid" || die "mlflow server exited during startup; last log lines: $(last_lines "$STATE_DIR/mlflow.log" 8)"
  ((SECONDS < deadline)) || die "mlflow server did not answer $URI/health within ${TIMEOUT_S}s; last log lines: $(last_lines "$STATE_DIR/mlflow.log" 8)"
  sleep 0.3
done
echo "$URI" >"$STATE_DIR/uri"
step "up: $URI (PostgreSQL 127.0.0.1:$PG_PORT, artifacts $STATE_DIR/artifacts)"
echo "export MLFLOW_TRACKING_URI=$URI"
