"""How the teachers and the student answer before training (``validation.teacher_baseline`` / ``eval_baseline``)."""

from __future__ import annotations

import functools
import logging
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from opd.distillation.config import MasterConfig
from opd.models.interfaces import GenerationInterface
from opd.rollout.multi_turn import Episodes
from opd.run.validation import TeacherEngine, validate

log = logging.getLogger("opd")


def validation_baselines(
    student_generation: GenerationInterface,
    teacher_generation: list[TeacherEngine],
    val_dataloader: StatefulDataLoader,
    tokenizer: Any,
    config: MasterConfig,
) -> dict[str, float]:
    """``validation.teacher_baseline`` / ``eval_baseline``: how teacher and student answer before training.

    Each teacher answers with its teacher-only context, if any, in its own tokens, graded with its own tokenizer;
    of several, each on its routed prompts or, in a mixture, every prompt (``val/teacher_<name>_*``). The eval
    baseline compares the starting student, without the context, with each teacher on its prompts. Each engine is
    closed once it has answered, so rollout workers free a teacher's weights before the next one loads.
    """
    if not (config.validation.teacher_baseline or config.validation.eval_baseline):
        return {}
    # Answers without a KL (no policy, no teacher to compare with); with an environment, in episodes.
    answer = functools.partial(
        validate,
        policy=None,
        teacher=None,
        val_dataloader=val_dataloader,
        generate_strategy=config.validation.generate_strategy,
        episodes=Episodes.from_config(config.environment),
    )
    metrics: dict[str, float] = {}
    for engine in teacher_generation:
        prefix = "val/teacher_" if engine.name is None else f"val/teacher_{engine.name}_"
        try:
            teacher_metrics = answer(
                engine.generation,
                tokenizer=engine.tokenizer,
                prefix=prefix,
                prompt_key=engine.prompt_key,
                keep=engine.answers,
            )
        finally:
            engine.generation.close()
        if config.validation.teacher_baseline:
            metrics.update(teacher_metrics)
        if not config.validation.eval_baseline:
            continue
        student_metrics = answer(student_generation, tokenizer=tokenizer, prefix="val/student_", keep=engine.answers)
        student_accuracy = student_metrics.get("val/student_accuracy")
        teacher_accuracy = teacher_metrics.get(f"{prefix}accuracy")
        if student_accuracy is None or teacher_accuracy is None:
            log.warning("validation.eval_baseline: the validation data has no ground truth; no accuracies")
            continue
        suffix = "" if engine.name is None else f"_{engine.name}"
        metrics[f"val/baseline_student_accuracy{suffix}"] = student_accuracy
        metrics[f"val/baseline_teacher_accuracy{suffix}"] = teacher_accuracy
        metrics[f"val/baseline_accuracy_gap{suffix}"] = teacher_accuracy - student_accuracy
    return metrics
