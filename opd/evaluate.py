"""``opd eval`` (and ``val_only: true``): validate one model against the teacher and exit.

The model is ``validation.model_path`` (an HF directory or a ``step_N`` checkpoint), else the run's newest
checkpoint, else ``model.student_model_path``. Metrics are printed and written to ``<log_dir>/eval_metrics.json``.

``opd eval --harness lm-eval --tasks ...`` scores it with an external harness instead (with
``validation.harness.compare``'s models beside it) and writes the table and results to ``<log_dir>``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from opd.data.dataloaders import make_eval_dataloader
from opd.distillation.config import MasterConfig, resolve_micro_batching
from opd.distillation.setup import build_generation, check_environment, load_models, run_tokenizer, set_seed
from opd.distillation.teacher_loading import load_teacher_members, teacher_tokenizer_of
from opd.distillation.teacher_plan import assemble_teacher
from opd.models.interfaces import CHECKPOINT_POLICY_DIR, TeacherInterface
from opd.policy.hf_policy import HFPolicy
from opd.rollout.multi_turn import Episodes
from opd.run.checkpoint import CheckpointManager, reading_checkpoint
from opd.run.harness import HarnessResults
from opd.run.run_setup import load_examples
from opd.run.training_loop import evaluate_run_models
from opd.run.validation import validate
from opd.utils.errors import ConfigError

log = logging.getLogger("opd")


def resolve_eval_model(config: MasterConfig) -> str:
    """The model directory ``opd eval`` validates (see the module docstring)."""
    model_path = config.validation.model_path
    if model_path is None:
        latest = CheckpointManager(config.checkpointing).latest_checkpoint()
        model_path = str(latest) if latest else config.model.student_model_path
    if (Path(model_path) / "policy" / "config.json").is_file():  # a step_N checkpoint
        model_path = str(Path(model_path) / "policy")
    return model_path


def restore_teacher(teacher: TeacherInterface, model_path: str) -> None:
    """A teacher that follows the student (``teacher.self_teacher: ema``) as the evaluated checkpoint kept it.

    A model directory outside a run has no teacher state; the teacher then starts from the student (logged).
    """
    directory = Path(model_path)
    checkpoint = directory.parent
    if directory.name == CHECKPOINT_POLICY_DIR and (checkpoint / "save_state.json").is_file():
        with reading_checkpoint(checkpoint):
            teacher.load_state_dict(CheckpointManager.load_teacher_state(checkpoint))
    elif teacher.state_dict():
        log.warning(
            "%s is not a checkpoint of the run: the teacher that follows the student (teacher.self_teacher) is the "
            "student's starting point",
            model_path,
        )


def evaluate(master_config: MasterConfig) -> dict[str, float]:
    """Validates one model against the teacher; prints and returns the metrics.

    Raises:
        ConfigError: if there is no validation data or the model cannot be found.
    """
    config = master_config
    if not config.data.has_validation:
        raise ConfigError("evaluation needs validation data: set data.val_path or data.val_holdout")
    check_environment(config)
    set_seed(config.training.seed)
    tokenizer = run_tokenizer(config)
    choice = config.teachers.choice() if config.teachers is not None else None
    context = config.distillation.teacher_context_spec()
    teacher_tokenizer = teacher_tokenizer_of(config)
    episodes = Episodes.from_config(config.environment)  # with an environment, the model answers in episodes
    examples = load_examples(
        config.data,
        tokenizer,
        "val",
        context,
        teacher_choice=choice,
        teacher_tokenizer=teacher_tokenizer,
        tools=None if episodes is None else episodes.tools_of,
    )
    model_path = resolve_eval_model(config)
    student_model, in_process = load_models(config, tokenizer, model_path)
    student_model.eval()
    members = load_teacher_members(config, tokenizer, in_process, student_path=model_path)
    teacher = assemble_teacher(config, tokenizer, teacher_tokenizer, members)
    restore_teacher(teacher, model_path)
    # A policy only for the student's logits: its optimizer never steps.
    policy = HFPolicy(student_model, config.training, resolve_micro_batching(config)[0], total_steps=1)
    generation = build_generation(config, student_model, tokenizer)
    try:
        metrics = validate(
            generation,
            policy,
            teacher,
            make_eval_dataloader(examples, config.validation.batch_size),
            tokenizer,
            config.validation.generate_strategy,
            config.validation.teacher_topk,
            loss_request=config.loss_fn.teacher_request(len(tokenizer)),
            episodes=episodes,
        )
    finally:
        generation.close()
        teacher.close()
    log_dir = Path(config.logger.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "eval_metrics.json").write_text(
        json.dumps({"model_path": model_path, **metrics}, indent=2), encoding="utf-8"
    )
    for key, value in metrics.items():
        print(f"{key:<28} {value:.4f}")
    print(f"evaluated {model_path} on {len(examples)} prompts; written to {log_dir / 'eval_metrics.json'}")
    return metrics


def evaluate_with_harness_tasks(config: MasterConfig) -> HarnessResults:
    """``opd eval --harness``: the model (and ``validation.harness.compare``'s) on ``validation.harness_tasks``.

    Raises:
        ConfigError: no tasks, the harness is not installed, or a task is unknown.
    """
    tasks = config.validation.harness_tasks
    if not tasks:
        raise ConfigError("opd eval --harness needs tasks: --tasks a,b (or validation.harness_tasks)")
    settings = config.validation.harness
    results = evaluate_run_models(config, resolve_eval_model(config))
    table_path = results.write(Path(config.logger.log_dir), settings)
    print(results.table())
    print(f"evaluated {', '.join(results.model_paths.values())} with {settings.name}; written to {table_path}")
    if settings.output_path is not None:
        print(f"{settings.name}'s own results{' and samples' if settings.log_samples else ''}: {settings.output_path}")
    return results
