#!/usr/bin/env bash
# The README's first command: install opd, then run the embedded CPU demo of on-policy
# distillation (tiny Qwen2 teacher -> tiny student, built locally, no downloads).
#
#   bash scripts/demo.sh [key.sub=value ...]     (extra arguments are config overrides)
#
# Each run writes to a new results/distillation_tiny/<date_time>/ directory (unless an
# output_dir=... override is given), so running the demo again never overwrites a run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
OUTPUT_ARGS=()
if [[ " $* " != *" output_dir="* ]]; then
  OUTPUT_ARGS=("output_dir=results/distillation_tiny/$(date +%Y%m%d_%H%M%S)")
fi
exec "${PYTHON:-python3}" -m opd train --config examples/configs/distillation_tiny.yaml "${OUTPUT_ARGS[@]}" "$@"
