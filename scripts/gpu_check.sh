#!/usr/bin/env bash
# The GPU path's checks on one GPU (scripts/gpu_check.py says what each one does), as one table.
#
#   bash scripts/gpu_check.sh [--only nccl_trainer bf16_fused_loss ...]
#
# Runs with the active Python environment, else the checkout's .venv. On a machine that
# cannot reach a package index, wheels put in .whl/ beforehand are installed from there
# (no dependencies resolved: put every missing one there).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -d .whl ]] && compgen -G ".whl/*.whl" >/dev/null; then
  PYTHON="${PYTHON:-python3}"
  "$PYTHON" -m pip install --quiet --no-deps --no-index .whl/*.whl
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  source scripts/python_env.sh
  bash scripts/install.sh
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
