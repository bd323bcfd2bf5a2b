"""On-policy knowledge distillation: the driver, ``distillation_train``.

One optimizer step (:func:`distillation_step`, see ``docs/guides/on-policy-distillation.md``):

1. flip the λ coin (a dedicated, checkpointed RNG): with probability ``lambda`` the step
   is on-policy and the student samples ``num_samples_per_prompt`` responses per prompt
   (after a refit, when the engine holds its own stale weights); otherwise the step uses
   fixed data (the dataset's assistant turn);
2. the frozen teacher scores the very same token ids, micro-batch by micro-batch, with
   the signal the loss asked for;
3. the student minimises the loss on response tokens, normalised over the whole global
   batch, with gradient accumulation over micro-batches and one optimizer step;
4. the step's metrics and the time of each phase are returned to the training loop,
   which logs them, validates every ``val_freq`` steps and checkpoints every
   ``save_freq`` steps (:mod:`opd.algorithms.training_loop`, shared with SFT).

The driver calls only the interfaces of :mod:`opd.models.interfaces`, as NeMo-RL's
``grpo_train`` does; :func:`opd.algorithms.distillation_setup.setup` builds the backends
and :mod:`opd.algorithms.distillation_config` holds the config.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from opd.algorithms.distillation_config import MasterConfig
from opd.algorithms.training_loop import RunSaveState, run_training_loop
from opd.algorithms.validation import validate
from opd.data.batched_data_dict import BatchedDataDict
from opd.data.batches import attach_teacher_prompts, build_fixed_data_batch, unique_responses_per_prompt
from opd.data.dataloaders import PreparedExample
from opd.data.sequences import build_token_mask
from opd.environments.math_verifier import grade_responses
from opd.models.interfaces import (
    GenerationInterface,
    LossFunction,
    PolicyInterface,
    TeacherInterface,
    TeacherSignal,
)
from opd.utils.checkpoint import CheckpointManager
from opd.utils.logger import Logger
from opd.utils.memory import peak_memory_mb
from opd.utils.timer import Timer

log = logging.getLogger("opd")

DistillationSaveState = RunSaveState
"""Counters saved in every checkpoint (see :class:`~opd.algorithms.training_loop.RunSaveState`)."""

_CONSOLE_KEYS = [
    "train/loss",
    "train/kl_forward",
    "train/kl_reverse",
    "train/kl_reverse_estimate",
    "train/on_policy",
    "train/mean_response_length",
    "perf/tokens_per_s",
]


@dataclass
class DistillationStepState:
    """What one step hands the next: the λ coin and whether the engine's weights are stale."""

    lambda_coin: random.Random
    generation_is_stale: bool = False


def distillation_step(
    examples: list[PreparedExample],
    state: DistillationStepState,
    student_policy: PolicyInterface,
    teacher_policy: TeacherInterface,
    student_generation: GenerationInterface,
    tokenizer: Any,
    loss_fn: LossFunction,
    config: MasterConfig,
) -> dict[str, Any]:
    """One optimizer step on a batch of prompts: λ coin → rollout or fixed data → teacher → train."""
    timer = Timer()
    with timer.time("step"):
        on_policy = state.lambda_coin.random() < config.distillation.lambda_
        if on_policy:
            if state.generation_is_stale:
                with timer.time("refit"):
                    student_generation.refit(student_policy)
            with timer.time("generation"):
                batch = build_on_policy_batch(examples, student_generation, loss_fn, config)
            if loss_fn.needs_task_reward:
                batch["task_reward"] = task_rewards(
                    batch, examples, config.distillation.num_samples_per_prompt, tokenizer
                )
        else:
            batch = build_fixed_data_batch(examples, tokenizer.pad_token_id, config.distillation.mask_prompt_tokens)

        request = loss_fn.teacher_request

        def teacher_signal(micro_batch: BatchedDataDict) -> TeacherSignal:
            assert request is not None  # passed to the trainer only when the loss asks for one
            with timer.time("teacher"):
                return teacher_policy.score(micro_batch, request)

        with timer.time("training"):
            train_metrics = student_policy.train(batch, loss_fn, teacher_signal if request is not None else None)
        state.generation_is_stale = student_generation.needs_refit
    seconds = timer.pop()
    # Phases a distributed trainer timed itself (its colocated teacher, the dispatch).
    for key in [key for key in train_metrics if key.endswith("_seconds")]:
        phase = key.removesuffix("_seconds")
        seconds[phase] = seconds.get(phase, 0.0) + train_metrics.pop(key)
    return step_metrics(train_metrics, batch, on_policy, seconds, config.distillation.num_samples_per_prompt)


def step_metrics(
    train_metrics: dict[str, float],
    batch: BatchedDataDict,
    on_policy: bool,
    seconds: dict[str, float],
    samples_per_prompt: int = 1,
) -> dict[str, Any]:
    """A step's logged metrics: the trainer's (``train/*``), the batch's, and each phase's time.

    ``timing/training`` excludes the teacher, which is scored inside the trainer's
    micro-batch loop and reported as ``timing/teacher``, and a distributed trainer's
    ``timing/dispatch`` (planning each rank's micro-batches). A distributed trainer also
    reports ``timing/trainer_compute``: the slowest rank's own time in the step, part of
    ``timing/training`` (the rest is the cost of calling the workers). On-policy steps also log
    ``train/unique_responses_per_prompt`` (out of ``samples_per_prompt``).
    """
    metrics: dict[str, Any] = {f"train/{key}": value for key, value in train_metrics.items()}
    metrics["train/on_policy"] = int(on_policy)
    if on_policy:
        metrics["train/unique_responses_per_prompt"] = unique_responses_per_prompt(batch, samples_per_prompt)
    if "task_reward" in batch:
        metrics["train/task_reward"] = float(batch["task_reward"].mean())
    metrics["train/mean_response_length"] = float(batch["response_lengths"].float().mean())
    metrics["train/truncation_rate"] = float(batch["truncated"].float().mean())
    if "refit" in seconds:
        metrics["timing/refit"] = seconds["refit"]
    metrics["timing/generation"] = seconds.get("generation", 0.0)
    metrics["timing/teacher"] = seconds.get("teacher", 0.0)
    for phase in ("dispatch", "trainer_compute"):  # a distributed trainer's own timings
        if phase in seconds:
            metrics[f"timing/{phase}"] = seconds[phase]
    metrics["timing/training"] = seconds["training"] - seconds.get("teacher", 0.0) - seconds.get("dispatch", 0.0)
    metrics["timing/step"] = seconds["step"]
    metrics["perf/tokens_per_s"] = float(batch["input_lengths"].sum()) / seconds["step"]
    metrics["perf/peak_memory_mb"] = peak_memory_mb()
    return metrics


def build_on_policy_batch(
    examples: list[PreparedExample],
    student_generation: GenerationInterface,
    loss_fn: LossFunction,
    config: MasterConfig,
) -> BatchedDataDict:
    """The on-policy branch: the student samples responses to the prompts."""
    student_generation.prepare_for_generation()
    try:
        batch = student_generation.generate(
            [example["prompt_ids"] for example in examples],
            config.distillation.generate_strategy,
            config.distillation.num_samples_per_prompt,
            # Computing the sampler's log-probs costs a log-softmax over the vocabulary at
            # every decoding step: only asked for when the loss reads them.
            return_logprobs=loss_fn.needs_sampler_logprobs,
        )
    finally:
        student_generation.finish_generation()
    batch["token_mask"] = build_token_mask(
        batch["input_lengths"],
        batch["prompt_lengths"],
        batch["input_ids"].shape[1],
        config.distillation.mask_prompt_tokens,
    )
    attach_teacher_prompts(batch, examples, config.distillation.num_samples_per_prompt)
    return batch


def task_rewards(
    batch: BatchedDataDict, examples: list[PreparedExample], num_samples: int, tokenizer: Any
) -> torch.Tensor:
    """``[N]`` task reward of each sampled response: 1.0 if the math verifier accepts it, else 0."""
    ground_truths = [examples[row // num_samples]["ground_truth"] for row in range(batch.size)]  # samples adjacent
    grades = grade_responses(
        batch["input_ids"], batch["prompt_lengths"], batch["input_lengths"], ground_truths, tokenizer
    )
    return torch.tensor([float(grade is True) for grade in grades], dtype=torch.float32)


def distillation_train(
    student_policy: PolicyInterface,
    teacher_policy: TeacherInterface,
    student_generation: GenerationInterface,
    teacher_generation: GenerationInterface | None,
    dataloader: StatefulDataLoader,
    val_dataloader: StatefulDataLoader | None,
    tokenizer: Any,
    loss_fn: LossFunction,
    logger: Logger,
    checkpointer: CheckpointManager,
    distillation_save_state: DistillationSaveState,
    master_config: MasterConfig,
) -> None:
    """Runs on-policy distillation until ``max_num_steps`` or ``num_epochs`` is reached.

    If ``distillation_save_state`` comes from a checkpoint (step > 0), the RNG streams,
    the λ coin and the data position are restored from that checkpoint first, so the
    remaining steps are exactly those of an uninterrupted run. SIGINT / SIGTERM finish
    the current step, write a checkpoint and return.

    Args:
        student_policy: the trainable student.
        teacher_policy: the frozen teacher (scores the very tokens the student trains on).
        student_generation: the engine that samples from the student.
        teacher_generation: the engine that samples from the teacher (validation
            baselines); None when the teacher is served.
        dataloader: resumable loader of prepared training examples (lists of dicts).
        val_dataloader: validation examples, or None to skip validation.
        tokenizer: shared tokenizer of teacher and student.
        loss_fn: the distillation loss (called per micro-batch).
        logger: metric sink.
        checkpointer: writes ``step_N`` checkpoints.
        distillation_save_state: run counters (step, epoch, consumed samples, best metric).
        master_config: the validated run config.

    Raises:
        TrainingDivergedError: after ``max_consecutive_nonfinite_steps`` skipped steps.
    """
    config = master_config
    state = DistillationStepState(
        random.Random(config.training.seed + 1), generation_is_stale=student_generation.needs_refit
    )

    def train_step(examples: list[PreparedExample]) -> dict[str, Any]:
        return distillation_step(
            examples, state, student_policy, teacher_policy, student_generation, tokenizer, loss_fn, config
        )

    def refresh_generation() -> None:
        if state.generation_is_stale:  # validation samples too: from the weights just trained
            student_generation.refit(student_policy)
            state.generation_is_stale = False

    def run_validation(data: StatefulDataLoader) -> dict[str, float]:
        refresh_generation()
        return validate(
            student_generation,
            student_policy,
            teacher_policy,
            data,
            tokenizer,
            config.validation.generate_strategy,
            config.validation.teacher_topk,
        )

    def baselines() -> None:
        """Once, on a fresh run: the teacher's answers (with its context, if any) and the eval baseline."""
        if val_dataloader is None or teacher_generation is None:
            return
        if config.validation.eval_baseline:  # the student answers too: from its current weights
            refresh_generation()
        metrics = validation_baselines(student_generation, teacher_generation, val_dataloader, tokenizer, config)
        if metrics:
            logger.log_metrics(metrics, 0, console_keys=list(metrics))

    run_training_loop(
        policy=student_policy,
        tokenizer=tokenizer,
        dataloader=dataloader,
        logger=logger,
        checkpointer=checkpointer,
        state=distillation_save_state,
        config=config,
        train_step=train_step,
        validate=(lambda: run_validation(val_dataloader)) if val_dataloader is not None else None,
        before_first_step=baselines,
        algorithm_rng=state.lambda_coin,
        console_keys=_CONSOLE_KEYS,
    )


def validation_baselines(
    student_generation: GenerationInterface,
    teacher_generation: GenerationInterface,
    val_dataloader: StatefulDataLoader,
    tokenizer: Any,
    config: MasterConfig,
) -> dict[str, float]:
    """``validation.teacher_baseline`` / ``eval_baseline``: how teacher and student answer before training.

    The teacher answers with its teacher-only context, if any; the eval baseline compares
    the student as it starts, without the context, with that teacher.
    """
    if not (config.validation.teacher_baseline or config.validation.eval_baseline):
        return {}
    strategy = config.validation.generate_strategy
    with_context = config.distillation.teacher_context_spec() is not None
    teacher_metrics = validate(
        teacher_generation,
        None,
        None,
        val_dataloader,
        tokenizer,
        strategy,
        prefix="val/teacher_",
        prompt_key="teacher_prompt_ids" if with_context else "prompt_ids",
    )
    metrics = dict(teacher_metrics) if config.validation.teacher_baseline else {}
    if config.validation.eval_baseline:
        student_metrics = validate(
            student_generation, None, None, val_dataloader, tokenizer, strategy, prefix="val/student_"
        )
        student_accuracy = student_metrics.get("val/student_accuracy")
        teacher_accuracy = teacher_metrics.get("val/teacher_accuracy")
        if student_accuracy is None or teacher_accuracy is None:
            log.warning("validation.eval_baseline: the validation data has no ground truth; no accuracies")
        else:
            metrics["val/baseline_student_accuracy"] = student_accuracy
            metrics["val/baseline_teacher_accuracy"] = teacher_accuracy
            metrics["val/baseline_accuracy_gap"] = teacher_accuracy - student_accuracy
    return metrics
