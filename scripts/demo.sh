#!/usr/bin/env bash
# The README's first command: install opd, then run the embedded CPU demo of on-policy
# distillation (examples/demo/run_demo.py): the committed tiny teacher, which solves
# 3-digit addition, teaches the committed smaller student on CPU in a few minutes; the
# demo prints the test accuracy of the teacher and of the student before and after.
#
#   bash scripts/demo.sh [key.sub=value ...]     (extra arguments are config overrides)
#
# Each run writes to a new results/demo/<date_time>/ directory (unless an output_dir=...
# override is given), so running the demo again never overwrites a run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
OUTPUT_ARGS=()
if [[ " $* " != *" output_dir="* ]]; then
  OUTPUT_ARGS=("output_dir=results/demo/$(date +%Y%m%d_%H%M%S)")
fi
exec "${PYTHON:-python3}" examples/demo/run_demo.py "${OUTPUT_ARGS[@]}" "$@"
