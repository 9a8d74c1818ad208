#!/usr/bin/env bash
# Run the test suite: set up if needed, make sure a Ray head answers at RAY_ADDRESS (starting a
# local one, stopped on exit, when none does), then pytest with every argument passed through.
#
#   scripts/test.sh                       # everything
#   scripts/test.sh tests/web -k launch   # a subset
#   scripts/test.sh -m "not browser"      # skip the Chromium tests
#   TLT_TEST_RAY=off scripts/test.sh tests/test_layout.py   # no Ray head (unit tests only)
#
# Celery workers for integration tests are started by the pytest fixtures, not here.
# Exit status is pytest's, except that "no tests collected" (pytest's 5) is a failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
TLT_LOG_TAG=test
cd "$TLT_ROOT"

"$TLT_ROOT/scripts/setup.sh"

export RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
export RAY_USAGE_STATS_ENABLED=0
export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1  # a native crash prints every thread's stack, even after pytest unhooks its own handler

TLT_RAY_PID=""
trap 'ray_head_stop' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ ${TLT_TEST_RAY:-auto} == off ]]; then
  tlt_log "TLT_TEST_RAY=off: not checking for a Ray head"
elif ray_reachable "$RAY_ADDRESS"; then
  tlt_log "using the Ray cluster at $RAY_ADDRESS"
else
  ray_head_start "$RAY_ADDRESS"
fi

rc=0
"$TLT_VENV/bin/python" -m pytest "$@" || rc=$?
if ((rc == 5)); then
  tlt_log "pytest collected no tests: failing (exit 1)"
  exit 1
fi
exit "$rc"
