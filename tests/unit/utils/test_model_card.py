"""``final_model/README.md``: the model card says what produced the model.

* the card parses as a Hugging Face model card (``huggingface_hub.ModelCard``) with the
  Hub's metadata; ``base_model`` / ``datasets`` appear for Hub names only, never for
  local paths or ``tiny:`` models;
* it names teacher, student, data, λ, loss, steps, the last validation metrics and the
  opd version, each taken from the config and the metrics log;
* a real run writes it, with exactly the last ``val/*`` record of its ``metrics.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import ModelCard
from opd_test_helpers import REPO_ROOT

import opd
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.run.model_card import last_validation, render_model_card
from opd.utils.config import load_config

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
MATH_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_math.yaml"
SFT_CONFIG = REPO_ROOT / "examples" / "configs" / "sft_arithmetic.yaml"
TRAIN = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"


def config_dict(path: Path, *overrides: str) -> dict:
    return load_config(MasterConfig, path, list(overrides)).model_dump(mode="json", by_alias=True)


def test_card_of_the_specification_case(tmp_path):
    config = config_dict(MATH_CONFIG, "distillation.lambda=0.5")
    mixed = render_model_card(config_dict(MATH_CONFIG, "loss_fn.kl_type=mixed", "loss_fn.mixed_kl_weight=0.3"), 1, None)
    assert "| loss | full_vocab (kl_type=mixed, mixed_kl_weight=0.3, temperature=1) |" in mixed
    text = render_model_card(config, 500, (500, {"val/accuracy": 0.4321, "val/kl_reverse": 0.125}))
    path = tmp_path / "README.md"
    path.write_text(text)
    card = ModelCard.load(path)
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert card.data.base_model == "Qwen/Qwen2.5-1.5B-Instruct"
    assert card.data.datasets == ["pe-nlp/math-cl"]
    assert "knowledge-distillation" in card.data.tags
    body = card.text
    assert "# Qwen2.5-1.5B-Instruct, distilled from Qwen/Qwen2.5-32B-Instruct" in body
    for row in (
        "| teacher | Qwen/Qwen2.5-32B-Instruct |",
        "| student | Qwen/Qwen2.5-1.5B-Instruct |",
        "| training data | pe-nlp/math-cl (math_cl) |",
        "| validation data | 256 rows held out of the training data |",
        "| λ (share of on-policy steps) | 0.5 |",
        "| loss | full_vocab (kl_type=reverse, temperature=1) |",
        "| optimizer steps | 500 |",
        "| val/accuracy | 0.4321 |",
        "| val/kl_reverse | 0.125 |",
        "| student sampling | 4 per prompt, top_k 50, temperature 0.1, up to 2048 new tokens |",
    ):
        assert row in body, row
    assert "Last validation, after step 500" in body
    assert f"opd {opd.__version__}" in body


def test_local_and_tiny_models_are_not_hub_metadata(tmp_path):
    config = config_dict(TINY_CONFIG, f"data.train_path={TRAIN}", "model.student_model_path=examples/demo/models/student")
    text = render_model_card(config, 3, None)
    (tmp_path / "README.md").write_text(text)
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model is None and card.data.datasets is None
    assert "No validation ran in this run." in card.text
    assert "| teacher | tiny:teacher |" in card.text


def test_last_validation_takes_the_last_val_record():
    records = [
        {"step": 0, "val/accuracy": 0.1},
        {"step": 1, "train/loss": 2.0},
        {"step": 2, "val/accuracy": 0.3, "val/kl_forward": 1.5, "timing/validation": 0.2},
        {"step": 3, "train/loss": 1.0},
    ]
    assert last_validation(records) == (2, {"val/accuracy": 0.3, "val/kl_forward": 1.5})
    assert last_validation([{"step": 1, "train/loss": 1.0}]) is None


def test_a_run_writes_the_card_with_its_last_validation(tmp_path):
    config = load_config(
        MasterConfig,
        TINY_CONFIG,
        [f"output_dir={tmp_path / 'run'}", f"data.train_path={TRAIN}", f"data.val_path={TRAIN}",
         "data.max_val_examples=4", "training.max_num_steps=2", "training.val_freq=1", "logger.console=false",
         "distillation.generate_strategy.max_length=8", "validation.generate_strategy.max_length=8"],
    )
    distillation_train(setup(config))
    card = ModelCard.load(Path(config.output_dir) / "final_model" / "README.md")
    records = [json.loads(line) for line in (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()]
    step, metrics = last_validation(records)
    assert step == 2
    assert f"Last validation, after step {step}" in card.text
    for name, value in metrics.items():
        assert f"| {name} | {value:.4g} |" in card.text
    assert "| optimizer steps | 2 |" in card.text


def test_sft_card():
    from opd.sft import SFTMasterConfig

    config = load_config(SFTMasterConfig, SFT_CONFIG, []).model_dump(mode="json", by_alias=True)
    text = render_model_card(config, 10, None)
    assert "| algorithm | supervised fine-tuning |" in text and "| teacher |" not in text
    assert "| loss | cross-entropy on the dataset's answers |" in text
