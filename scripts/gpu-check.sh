#!/usr/bin/env bash
# GPU readiness on a lent GPU machine (torch and transformers only: no Ray, no vLLM, no network):
# one FSDP2 learner step at one rank on CUDA, the rank's bucketed weight publish, and the built-in
# engine's rollout (full batch, then the tail plain and with SD) on a random-init 1B-class Llama.
# Prints one JSON line last; exits non-zero if a check failed. Takes a few minutes (limit: 8).
#
#   scripts/gpu-check.sh                  # python3 from PATH (or $PYTHON)
#   scripts/gpu-check.sh --shape tiny --device cpu   # try it on a laptop
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] && [[ -z ${PYTHON:-} ]] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec timeout 480 "$PY" -m workers.tlt.bench.gpu_check "$@"
