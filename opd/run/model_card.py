"""``final_model/README.md``: a Hugging Face model card saying what produced the model.

The Hub's YAML metadata (``base_model`` / ``datasets`` only for Hub names, not local paths), then the run in prose
and tables. Everything comes from the validated config and the logged metrics, so the card cannot disagree with the run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

import opd

# owner/name, as the Hub spells repository ids; anything else (a local path, tiny:...) is not one.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

CARD_FILENAME = "README.md"


def _hub_id(path: Any) -> str | None:
    """``path`` when it names a Hub repository (and no local directory of that name exists)."""
    if not isinstance(path, str) or not _HUB_ID.match(path) or Path(path).exists():
        return None
    return path


def _get(config: Mapping[str, Any], dotted: str) -> Any:
    """``config["a"]["b"]`` for ``"a.b"``; None where a key is missing."""
    value: Any = config
    for key in dotted.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _loss_summary(loss: Mapping[str, Any] | None) -> str:
    """``full_vocab (kl_type=reverse, temperature=1.0)``: the loss type and its main settings."""
    if not loss:
        return "cross-entropy on the dataset's answers"
    main = ["kl_type", "mixed_kl_weight", "beta", "k", "tail", "temperature", "teacher_tau", "student_tau"]
    if loss.get("kl_type") != "mixed":  # the weight only means something for a mixed KL
        main.remove("mixed_kl_weight")
    settings = ", ".join(f"{key}={_format_value(loss[key])}" for key in main if key in loss)
    return f"{loss.get('type', '?')} ({settings})" if settings else str(loss.get("type", "?"))


def _metadata(config: Mapping[str, Any], student: Any, distillation: bool) -> dict[str, Any]:
    tags = ["opd", "knowledge-distillation", "on-policy-distillation"] if distillation else ["opd", "sft"]
    metadata: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": "text-generation", "tags": tags}
    if _hub_id(student):
        metadata["base_model"] = student
    dataset = _hub_id(_get(config, "data.train_path"))
    if dataset:
        metadata["datasets"] = [dataset]
    return metadata


def _run_rows(config: Mapping[str, Any], student: Any, steps: int, distillation: bool) -> list[tuple[str, str]]:
    """The "Training" table: one (what, value) row per fact, those that apply to this run."""
    rows = [("algorithm", "on-policy distillation" if distillation else "supervised fine-tuning")]
    if distillation:
        remote = _get(config, "teacher.backend") == "remote"
        teacher = _get(config, "teacher.remote.url") if remote else _get(config, "model.teacher_model_path")
        rows.append(("teacher", f"{teacher} (served)" if remote else str(teacher)))
    rows.append(("student" if distillation else "base model", str(student)))
    lora = _get(config, "model.lora")
    if lora:
        rows.append(("LoRA", ", ".join(f"{key}={_format_value(value)}" for key, value in lora.items())))
    rows.append(("training data", f"{_get(config, 'data.train_path')} ({_get(config, 'data.data_format')})"))
    holdout = _get(config, "data.val_holdout")
    validation = f"{holdout} rows held out of the training data" if holdout else _get(config, "data.val_path")
    rows.append(("validation data", str(validation or "none")))
    if distillation:
        rows.append(("λ (share of on-policy steps)", _format_value(_get(config, "distillation.lambda"))))
        strategy = _get(config, "distillation.generate_strategy") or {}
        method = strategy.get("decoding_method")
        if strategy.get(method) is not None:  # top_k, top_p: the method's own setting has its name
            method = f"{method} {strategy.get(method)}, temperature {strategy.get('temperature')}"
        samples = _get(config, "distillation.num_samples_per_prompt")
        rows.append(
            ("student sampling", f"{samples} per prompt, {method}, up to {strategy.get('max_length')} new tokens")
        )
    rows.append(("loss", _loss_summary(_get(config, "loss_fn"))))
    rows.append(("optimizer steps", str(steps)))
    rows.append(("prompts per step", str(_get(config, "training.batch_size"))))
    rows.append(("learning rate", _format_value(_get(config, "training.learning_rate"))))
    rows.append(("seed", str(_get(config, "training.seed"))))
    return rows


def render_model_card(
    config: Mapping[str, Any],
    steps: int,
    validation: tuple[int, Mapping[str, float]] | None,
    harness_table: str | None = None,
) -> str:
    """The card's text; ``config`` is ``model_dump(mode="json", by_alias=True)``, ``validation`` the last or None."""
    distillation = _get(config, "distillation") is not None
    student = _get(config, "model.student_model_path") or _get(config, "model.model_path")
    lines = ["---", yaml.safe_dump(_metadata(config, student, distillation), sort_keys=False).rstrip(), "---", ""]
    if distillation:
        title = f"{Path(str(student)).name}, distilled from {_get(config, 'model.teacher_model_path') or 'a teacher'}"
        lines += [
            f"# {title}",
            "",
            "This model was trained with opd by on-policy knowledge distillation: the "
            "student generated responses to the training prompts (with probability λ per step; otherwise it "
            "trained on fixed data), a frozen teacher scored every token of them, and the student minimised "
            "the divergence below to the teacher's next-token distributions.",
        ]
    else:
        lines += [f"# {Path(str(student)).name}, fine-tuned", "", "Supervised fine-tuning with opd."]
    lines += ["", "## Training", "", "| | |", "|---|---|"]
    lines += [f"| {what} | {value} |" for what, value in _run_rows(config, student, steps, distillation)]
    lines += ["", "## Validation", ""]
    if validation is None:
        lines.append("No validation ran in this run.")
    else:
        step, metrics = validation
        lines += [f"Last validation, after step {step}:", "", "| metric | value |", "|---|---|"]
        lines += [f"| {name} | {_format_value(value)} |" for name, value in sorted(metrics.items())]
    if harness_table is not None:
        harness = _get(config, "validation.harness.name") or "an external harness"
        lines += ["", "## Evaluation", "", f"The final model through {harness} (`validation.harness_tasks`):", ""]
        lines += [harness_table]
    lines += [
        "",
        "## Framework",
        "",
        f"opd {opd.__version__}. The full configuration is in the run's checkpoints (`config.yaml`).",
        "",
    ]
    return "\n".join(lines)


def last_validation(records: list[dict[str, Any]]) -> tuple[int, dict[str, float]] | None:
    """``(step, val/* metrics)`` of the last record of ``metrics.jsonl`` that holds validation metrics."""
    for record in reversed(records):
        metrics = {key: value for key, value in record.items() if key.startswith("val/")}
        if metrics:
            return int(record.get("step", 0)), metrics
    return None
