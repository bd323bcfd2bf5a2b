#!/usr/bin/env bash
# The README's second command: install opd with its test extra, then run the test suite
# (unit tests and the functional CPU run of tests/functional/distillation.sh).
#
#   bash scripts/test.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec "${PYTHON:-python3}" -m pytest "$@"
