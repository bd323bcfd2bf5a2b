#!/usr/bin/env bash
# Installs opd (editable) and its dependencies into the Python environment that
# scripts/python_env.sh chooses: PYTHON if set; else the active virtual or conda
# environment; else the checkout's .venv, created on first use (never the system's Python).
#
#   bash scripts/install.sh [EXTRAS]      e.g. bash scripts/install.sh test
#
# PyTorch is handled first, because a bare `torch` requirement pulls several GB of CUDA
# packages: an already installed torch is kept as it is (one older than pyproject.toml's
# bound is refused, with what to do); on a machine with an NVIDIA GPU the default (CUDA)
# build is installed; otherwise the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
EXTRAS="${1:-}"
export PIP_ROOT_USER_ACTION=ignore  # installing as root in a container is deliberate
# pip byte-compiles every module it installs (most of an install's CPU time), and must: where
# PYTHONDONTWRITEBYTECODE is set (as in many container images) Python never keeps the modules
# it compiles on import, so every process would compile everything it imports, every time.
# (.ci/run keeps Python's cache on and turns pip's compilation off: PIP_COMPILE=false.)
PIP=("$PYTHON" -m pip install --quiet --disable-pip-version-check)

# pyproject.toml's bound on torch (the newest torch API opd calls sets it).
TORCH_FLOOR="$(sed -n 's/^ *"torch>=\([0-9.]*\)",$/\1/p' pyproject.toml)"
# The installed torch's version from its metadata: importing torch (seconds) for it would cost
# every later call of this script (CI and the test scripts call it several times) that much.
TORCH_VERSION="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
if [ -n "$TORCH_VERSION" ]; then
  # Refused rather than kept: pip would otherwise swap it for PyPI's default (CUDA) build.
  if ! "$PYTHON" - "$TORCH_VERSION" "$TORCH_FLOOR" <<'PY'
import re, sys
have, floor = (tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", text).groups()) for text in sys.argv[1:])
sys.exit(have < floor)
PY
  then
    echo "[install] the installed torch $TORCH_VERSION is older than opd needs (torch>=$TORCH_FLOOR);" \
      "upgrade it first, e.g. pip install 'torch>=$TORCH_FLOOR' from your CUDA build's index" >&2
    exit 1
  fi
  echo "[install] keeping the installed torch $TORCH_VERSION"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[install] NVIDIA GPU found: installing the CUDA build of torch"
  "${PIP[@]}" torch
else
  echo "[install] no GPU: installing the CPU build of torch"
  # A local wheel (pip find-links) or PyTorch's CPU index; never the multi-GB CUDA wheels.
  "${PIP[@]}" "torch==2.13.0+cpu" 2>/dev/null \
    || "${PIP[@]}" torch --index-url https://download.pytorch.org/whl/cpu
fi

# A rerun with nothing changed skips pip's resolver (10-20 s on 2 cores): a stamp in the
# environment records the extras installed from this checkout and pyproject.toml's hash.
# OPD_FORCE_INSTALL=1 installs again regardless.
PREFIX="$("$PYTHON" -c 'import sys; print(sys.prefix)')"
STAMP="$PREFIX/.opd-installed-${EXTRAS:-base}"
KEY="$PWD $("$PYTHON" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
if [ "${OPD_FORCE_INSTALL:-0}" != "1" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] \
  && "$PYTHON" -c "import opd" 2>/dev/null; then
  echo "[install] opd${EXTRAS:+[$EXTRAS]} is already installed into $PREFIX from this checkout (OPD_FORCE_INSTALL=1 installs again)"
  exit 0
fi
rm -f "$STAMP" 2>/dev/null || true
if [ -n "$EXTRAS" ]; then
  "${PIP[@]}" -e ".[$EXTRAS]"
else
  "${PIP[@]}" -e .
fi
# opd's own modules byte-compiled once: an editable install leaves them to Python, which
# keeps nothing where PYTHONDONTWRITEBYTECODE is set, so every process would compile them.
"$PYTHON" -m compileall -q opd >/dev/null || true
{ echo "$KEY" > "$STAMP"; } 2>/dev/null || true  # a prefix we may not write to keeps no stamp
echo "[install] opd installed into $PREFIX"
