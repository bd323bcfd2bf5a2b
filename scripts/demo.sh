#!/usr/bin/env bash
# The README's first command: install opd, then run the embedded CPU demo of on-policy
# distillation (examples/demo/run_demo.py): the committed tiny teacher, which solves
# 3-digit addition, teaches the committed smaller student on CPU in a few minutes; the
# demo prints the test accuracy of the teacher and of the student before and after.
#
#   bash scripts/demo.sh [key.sub=value ...]     (extra arguments are config overrides)
#
# Where no virtual or conda environment is active, opd is installed into the checkout's
# .venv, created on first use (scripts/python_env.sh); PYTHON=... picks the interpreter.
#
# Each run writes to a new results/demo/<date_time>/ directory (unless an output_dir=...
# override is given), so running the demo again never overwrites a run.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
bash scripts/install.sh
OUTPUT_ARGS=()
if [[ " $* " != *" output_dir="* ]]; then
  OUTPUT_ARGS=("output_dir=results/demo/$(date +%Y%m%d_%H%M%S)")
fi
# ${a[@]+...}: an empty array under `set -u` is an error in bash < 4.4 (macOS ships 3.2).
exec "$PYTHON" examples/demo/run_demo.py ${OUTPUT_ARGS[@]+"${OUTPUT_ARGS[@]}"} "$@"
