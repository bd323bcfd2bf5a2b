#!/usr/bin/env bash
# Static checks over opd/: ruff (lint and format) and mypy. Installs them if missing.
#
#   bash scripts/lint.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh  # PYTHON: the active environment, else the checkout's .venv
if ! "$PYTHON" -m ruff --version >/dev/null 2>&1 || ! "$PYTHON" -m mypy --version >/dev/null 2>&1; then
  PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --quiet --disable-pip-version-check "ruff>=0.6" "mypy>=1.11"
fi
"$PYTHON" -m ruff check opd
"$PYTHON" -m ruff format --check opd
"$PYTHON" -m mypy
echo "[lint] ruff and mypy: clean"
