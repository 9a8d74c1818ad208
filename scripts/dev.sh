#!/usr/bin/env bash
# Run the whole platform on this machine: set up, migrate, create the demo team and user (the
# login is printed the first time only), then start a local Ray head, a Celery worker, the Celery
# beat scheduler (its own process: a killed worker cannot orphan it) and the web app on
# http://127.0.0.1:8000. Ctrl-C stops everything this script started.
#
#   scripts/dev.sh
#
# Idempotent: a Ray cluster already answering at RAY_ADDRESS is reused (and left running).
# Environment: see .env.example and README.md (defaults: SQLite and a filesystem broker under var/).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
TLT_LOG_TAG=dev
cd "$TLT_ROOT"

WEB_HOST="${TLT_DEV_HOST:-127.0.0.1}"
WEB_PORT="${TLT_DEV_PORT:-8000}"
export RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
export TLT_PUBLIC_URL="${TLT_PUBLIC_URL:-http://$WEB_HOST:$WEB_PORT}"
export DEBUG="${DEBUG:-true}"
export RAY_USAGE_STATS_ENABLED=0
export PYTHONUNBUFFERED=1

port_in_use() {
  "$TLT_PY" - "$1" "$2" <<'PY' 2>/dev/null
import socket, sys
with socket.socket() as s:
    s.settimeout(1)
    sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 1)
PY
}

"$TLT_ROOT/scripts/setup.sh" # includes migrate
if port_in_use "$WEB_HOST" "$WEB_PORT"; then
  tlt_die "$WEB_HOST:$WEB_PORT is already in use (another scripts/dev.sh?); set TLT_DEV_PORT"
fi

TLT_RAY_PID=""
CHILD_PIDS=()
cleanup() {
  trap - EXIT INT TERM
  local pid
  for pid in "${CHILD_PIDS[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${CHILD_PIDS[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  ray_head_stop
  tlt_log "stopped"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if ray_reachable "$RAY_ADDRESS"; then
  tlt_log "reusing the Ray cluster at $RAY_ADDRESS"
else
  ray_head_start "$RAY_ADDRESS"
fi

# Demo team + user (prints the login once) and, the first time, the quick demo run.
"$TLT_PY" manage.py tlt_demo

mkdir -p var/log
"$TLT_VENV/bin/celery" -A workers.celery_app worker --loglevel=INFO --concurrency=2 &
CHILD_PIDS+=($!)
"$TLT_VENV/bin/celery" -A workers.celery_app beat --loglevel=INFO --schedule var/celerybeat-schedule &
CHILD_PIDS+=($!)

"$TLT_PY" manage.py runserver "$WEB_HOST:$WEB_PORT" &
CHILD_PIDS+=($!)

tlt_log "TLT Platform on http://$WEB_HOST:$WEB_PORT  (Ray dashboard $RAY_ADDRESS; Ctrl-C stops all)"
# Stop everything as soon as one of the services dies.
rc=0
wait -n "${CHILD_PIDS[@]}" || rc=$?
tlt_log "a service exited (status $rc); shutting down"
exit "$rc"
