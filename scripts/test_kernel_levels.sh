#!/usr/bin/env bash
# The tests that compare float32 computations, once more on other CPU kernels than the suite's.
#
#   bash scripts/test_kernel_levels.sh [pytest arguments]
#
# OPD_KERNEL_LEVELS="avx512 default" names the levels (ATEN_CPU_CAPABILITY: avx512, avx2, default);
# OPD_KERNEL_TESTS="tests/reference ..." replaces the test files (below).
# tests/conftest.py runs the suite on PyTorch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, so
# that the recordings under tests/reference hold on every x86-64 machine). Kernels of
# another level round float32 sums, exp and log differently; so does another CPU's BLAS,
# which ATEN_CPU_CAPABILITY does not choose. The tolerances of these tests are derived
# from float32 rounding (tests/opd_float_tolerance.py, tests/reference/), not fitted to
# one machine, and this runs them where the rounding differs: unless told, at the machine's
# own level (where it is not AVX2) and at `default` (no vector kernels). The Ray workers of
# the cluster tests inherit the level.
#
# The files: the recorded losses and tiny runs, and every cluster run compared with the
# same run in one process; their `slow` tests are left out (CI's second run runs the slow
# tier on the machine's own kernels).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh  # PYTHON: the active environment, else the checkout's .venv
DEFAULT_TESTS=(
  tests/reference/test_reference_losses.py
  tests/reference/test_reference_runs.py
  tests/distributed/test_cluster_equivalence.py
  tests/distributed/test_cluster_lora.py
  tests/distributed/test_cluster_multi_turn.py
  tests/distributed/test_exact_signal_transport.py
  tests/distributed/test_sharded_teacher_pool.py
  tests/distributed/test_cluster_teachers.py
  tests/distributed/test_cluster_context_distillation.py
  tests/distributed/test_cluster_async_teachers.py
)
# Whitespace-separated (newlines included); `read -d ''` ends at the input's end with status 1.
read -r -d '' -a NUMERIC_TESTS <<<"${OPD_KERNEL_TESTS:-${DEFAULT_TESTS[*]}}" || true
read -r -d '' -a LEVELS <<<"${OPD_KERNEL_LEVELS:-}" || true
if [ "${#LEVELS[@]}" -eq 0 ]; then
  native="$(env -u ATEN_CPU_CAPABILITY "$PYTHON" -c 'import torch; print(torch.backends.cpu.get_cpu_capability().lower())')"
  if [ "$native" != avx2 ]; then
    LEVELS+=("$native")
  fi
  LEVELS+=(default)
fi
for level in "${LEVELS[@]}"; do
  started=$SECONDS
  echo "[kernels] ATEN_CPU_CAPABILITY=$level: ${#NUMERIC_TESTS[@]} test files"
  ATEN_CPU_CAPABILITY="$level" OPD_SKIP_VLLM_TESTS=1 bash scripts/test.sh -m "not slow" "${NUMERIC_TESTS[@]}" "$@"
  echo "[kernels] ATEN_CPU_CAPABILITY=$level: $(( SECONDS - started )) s"
done
