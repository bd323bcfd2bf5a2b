#!/usr/bin/env bash
# Runs every script in benchmarks/ with --smoke (its smallest sizes, a few steps) and fails
# if any fails, so that a change that breaks a benchmark is caught. The figures a smoke run
# prints mean nothing. Each script prepares its own data and models; nothing is downloaded.
#
#   bash scripts/smoke_benchmarks.sh [NAME ...]     # default: every benchmark
#
# Runs OPD_SMOKE_JOBS scripts at a time (default 2, one thread each), slowest first, with
# their output in a temporary directory; prints one line per script and, for each that
# failed, the end of its output. A script that needs vLLM says in one line that it skipped
# where vllm is not importable; OPD_SMOKE_VLLM_PYTHON=.venv-vllm/bin/python (the environment
# scripts/install_vllm_env.sh builds) runs those with that interpreter instead (about a
# minute more). OPD_SMOKE_SKIP="NAME ..." leaves those scripts out (CI: the ones a test
# already runs end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh  # PYTHON: the active environment, else the checkout's .venv
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RAY_USAGE_STATS_ENABLED=0
JOBS="${OPD_SMOKE_JOBS:-2}"
VLLM_BENCHMARKS=(generation_engines)  # the scripts that need vllm

# Every script with a main block (benchmarks/harness.py and timing.py are modules); the
# slowest first (their smoke seconds in CI's run of 2026-11-29, in this order: 102, new, 40 37 26 36 36 –
# 30 32 19 12; dry_run_accuracy's left out there), so that the last ones to start are short and the two
# jobs end together.
SLOWEST=(e2e_vs_trl real_model_study sweep_lambda_kl async_overlap scaling tool_demo validation_bytes dry_run_accuracy
  lambda_study step_kernels served_teacher loss_memory)
if [ "$#" -gt 0 ]; then
  NAMES=("$@")
else
  NAMES=("${SLOWEST[@]}")
  for path in benchmarks/*.py; do
    name="$(basename "$path" .py)"
    if grep -q '^if __name__ == "__main__":' "$path" && [[ " ${SLOWEST[*]} " != *" $name "* ]]; then
      NAMES+=("$name")
    fi
  done
fi
KEPT=()
for name in "${NAMES[@]}"; do
  if [[ " ${OPD_SMOKE_SKIP:-} " == *" $name "* ]]; then
    echo "[smoke] $name: left out (OPD_SMOKE_SKIP)"
  else
    KEPT+=("$name")
  fi
done
NAMES=(${KEPT[@]+"${KEPT[@]}"})
for name in ${NAMES[@]+"${NAMES[@]}"}; do
  if [ ! -f "benchmarks/$name.py" ]; then
    echo "[smoke] error: no benchmarks/$name.py" >&2
    exit 1
  fi
done

LOGS="$(mktemp -d "${TMPDIR:-/tmp}/opd_smoke_benchmarks.XXXXXX")"
trap 'rm -rf "$LOGS"' EXIT

run_one() {
  local name="$1" start=$SECONDS python="$PYTHON"
  if [ -n "${OPD_SMOKE_VLLM_PYTHON:-}" ] && [[ " ${VLLM_BENCHMARKS[*]} " == *" $name "* ]]; then
    python="$OPD_SMOKE_VLLM_PYTHON"
  fi
  if "$python" "benchmarks/$name.py" --smoke >"$LOGS/$name.log" 2>&1; then
    echo "[smoke] $name: ok ($((SECONDS - start)) s)"
  else
    echo "[smoke] $name: FAILED (exit $?, $((SECONDS - start)) s)"
    touch "$LOGS/$name.failed"
  fi
}

start=$SECONDS
for name in ${NAMES[@]+"${NAMES[@]}"}; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do
    wait -n || true
  done
  run_one "$name" &
done
wait

failed=0
for name in ${NAMES[@]+"${NAMES[@]}"}; do
  if [ -e "$LOGS/$name.failed" ]; then
    failed=$((failed + 1))
    echo
    echo "[smoke] ---- the end of benchmarks/$name.py --smoke's output ----"
    tail -n 40 "$LOGS/$name.log"
  fi
done
echo "[smoke] ${#NAMES[@]} benchmarks, $failed failed, $((SECONDS - start)) s ($JOBS at a time)"
[ "$failed" -eq 0 ]
