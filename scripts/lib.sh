# Shared helpers for scripts/*.sh and .ci/run. Source it; it defines functions and variables only.
# shellcheck shell=bash

TLT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TLT_VENV="$TLT_ROOT/.venv"
TLT_PY="$TLT_VENV/bin/python"

# The Ray head always uses GCS port 6380: Redis owns 6379 on every machine we run on.
TLT_RAY_GCS_PORT="${TLT_RAY_GCS_PORT:-6380}"
TLT_RAY_NUM_CPUS="${TLT_RAY_NUM_CPUS:-2}"
# The head keeps its sessions in a temp dir of its own: Ray hands every job's driver the cluster named in
# <temp dir>/ray_current_cluster, and in the shared /tmp/ray any other Ray started on the machine since
# (another checkout's head, a test's ray.init()) overwrites that file, so the driver would join it.
TLT_RAY_TEMP_DIR="${TLT_RAY_TEMP_DIR:-/tmp/ray-tlt-$TLT_RAY_GCS_PORT}"

tlt_log() { printf '[%s] %s\n' "${TLT_LOG_TAG:-tlt}" "$*" >&2; }
tlt_die() { tlt_log "error: $*"; exit 1; }

# http_ok URL: true when something answers HTTP 2xx/3xx at URL within 2 s. Sends the local Ray
# cluster's token when one exists: Ray 2.5x turns on token auth for heads started after any local
# ray.init() wrote ~/.ray/auth_token, and then answers 401 without it.
http_ok() {
  "$TLT_PY" - "$1" <<'PY' 2>/dev/null
import os, pathlib, sys, urllib.request
req = urllib.request.Request(sys.argv[1])
token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
path = pathlib.Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or pathlib.Path.home() / ".ray" / "auth_token")
if not token and path.is_file():
    token = path.read_text().strip()
if token:
    req.add_header("Authorization", f"Bearer {token}")
try:
    urllib.request.urlopen(req, timeout=2)
except Exception:
    sys.exit(1)
PY
}

# ray_dashboard_port URL -> the port of the Ray dashboard URL (default 8265).
ray_dashboard_port() {
  local url="${1%/}" port
  port="${url##*:}"
  [[ $port =~ ^[0-9]+$ ]] || port=8265
  printf '%s' "$port"
}

free_port() { "$TLT_PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

ray_reachable() { http_ok "${1%/}/api/version"; }

# ray_head_start URL: start a local Ray head whose dashboard/job API answers at URL.
# Runs `ray start --block` in the background so stopping it (ray_head_stop) stops exactly the
# processes it started, and nothing else on the machine. Sets TLT_RAY_PID.
ray_head_start() {
  local url="$1" log_file="$TLT_ROOT/var/log/ray-head.log" port
  port="$(ray_dashboard_port "$url")"
  mkdir -p "$TLT_ROOT/var/log"
  # A stale pointer from a killed head makes a plain ray.init() hang: drop it when nothing answers.
  if [[ -f $TLT_RAY_TEMP_DIR/ray_current_cluster ]] && ! ray_reachable "$url"; then
    rm -f "$TLT_RAY_TEMP_DIR/ray_current_cluster"
  fi
  # The job agent's HTTP port defaults to 52365 for every Ray instance on the host; if another one
  # (a test's local ray.init(), another checkout) holds it, the head starts but every job
  # submission fails with "No available agent". Give the head a port nobody else holds.
  # Likewise the Ray client server's 10001, so two checkouts can each run a head side by side.
  local agent_port client_port
  agent_port="$(free_port)"
  client_port="$(free_port)"
  tlt_log "starting Ray head (GCS :$TLT_RAY_GCS_PORT, dashboard :$port, job agent :$agent_port, log $log_file)"
  RAY_USAGE_STATS_ENABLED=0 setsid "$TLT_VENV/bin/ray" start --head --block \
    --port "$TLT_RAY_GCS_PORT" --temp-dir "$TLT_RAY_TEMP_DIR" \
    --dashboard-host 127.0.0.1 --dashboard-port "$port" \
    --dashboard-agent-listen-port "$agent_port" \
    --ray-client-server-port "$client_port" \
    --num-cpus "$TLT_RAY_NUM_CPUS" --disable-usage-stats \
    >"$log_file" 2>&1 &
  TLT_RAY_PID=$!
  local deadline=$((SECONDS + ${TLT_RAY_START_TIMEOUT:-120}))
  until ray_reachable "$url"; do
    if ! kill -0 "$TLT_RAY_PID" 2>/dev/null; then
      tail -n 40 "$log_file" >&2 || true
      tlt_die "Ray head exited during start (see $log_file)"
    fi
    ((SECONDS < deadline)) || { tail -n 40 "$log_file" >&2; tlt_die "Ray head did not answer at $url"; }
    sleep 1
  done
  tlt_log "Ray head is up at $url"
}

# ray_head_stop: stop the head started by ray_head_start (SIGTERM lets `ray start --block`
# shut its own raylet, GCS and dashboard down), then drop its address file.
ray_head_stop() {
  [[ -n ${TLT_RAY_PID:-} ]] || return 0
  if kill -0 "$TLT_RAY_PID" 2>/dev/null; then
    tlt_log "stopping Ray head (pid $TLT_RAY_PID)"
    kill -TERM "$TLT_RAY_PID" 2>/dev/null || true
    local i
    for i in $(seq 1 30); do
      kill -0 "$TLT_RAY_PID" 2>/dev/null || break
      sleep 1
    done
    if kill -0 "$TLT_RAY_PID" 2>/dev/null; then
      tlt_log "Ray head still running; killing its process group"
      kill -KILL -- "-$TLT_RAY_PID" 2>/dev/null || true
    fi
  fi
  rm -f "$TLT_RAY_TEMP_DIR/ray_current_cluster"
  TLT_RAY_PID=""
}
