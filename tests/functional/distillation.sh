#!/usr/bin/env bash
# Functional test: a few steps of the tiny CPU distillation config, end to end.
# Checks that every step logged a finite loss and KL and that the final student loads
# with AutoModelForCausalLM.from_pretrained and generates.
#
#   bash tests/functional/distillation.sh [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
OUT="${1:-$(mktemp -d)/opd_functional}"
STEPS=4

"$PYTHON" examples/run_distillation.py --config examples/configs/distillation_tiny.yaml \
  output_dir="$OUT" training.max_num_steps=$STEPS training.val_freq=0 training.save_freq=2 \
  distillation.generate_strategy.max_length=16 validation.generate_strategy.max_length=16

"$PYTHON" - "$OUT" "$STEPS" <<'PY'
import json, math, sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

out, steps = Path(sys.argv[1]), int(sys.argv[2])
records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
train = [r for r in records if "train/loss" in r]
assert [r["step"] for r in train] == list(range(1, steps + 1)), [r["step"] for r in train]
for record in train:
    for key in ("train/loss", "train/kl_forward", "train/kl_reverse", "train/grad_norm"):
        assert isinstance(record[key], float) and math.isfinite(record[key]), (key, record[key])
val = [r for r in records if "val/kl_reverse" in r]
assert len(val) == 2, "expected validation at start and end"
assert (out / "checkpoints" / "step_2" / "save_state.json").is_file(), "no step_2 checkpoint"
assert (out / "checkpoints" / f"step_{steps}" / "policy" / "model.safetensors").is_file()

model = AutoModelForCausalLM.from_pretrained(out / "final_model")
tokenizer = AutoTokenizer.from_pretrained(out / "final_model")
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False, add_generation_prompt=True)
ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
with torch.no_grad():
    generated = model.generate(**ids, max_new_tokens=4, do_sample=False)
assert generated.shape[1] > ids["input_ids"].shape[1]
print(f"functional distillation OK: {steps} steps, final loss {train[-1]['train/loss']:.4f}, model reloaded")
PY
