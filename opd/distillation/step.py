"""On-policy knowledge distillation: the driver, ``distillation_train``.

One optimizer step (:meth:`DistillationRun.train_step`, walked through in ``docs/guide/``):

1. the rollout schedule (:mod:`opd.distillation.schedule`, ``training.scheduler``)
   hands over the step's batch. It flipped the λ coin (a dedicated, checkpointed RNG)
   when it started the batch: with probability ``lambda`` the step is on-policy and the
   student sampled ``num_samples_per_prompt`` responses per prompt (after a weight sync,
   when the engine holds its own weights); otherwise the step uses fixed data (the
   dataset's assistant turn). ``sync`` samples now; ``one_step_off`` and
   ``two_step_off`` sampled one or two steps ago, while earlier steps trained;
2. the teacher scores the very same token ids, micro-batch by micro-batch, with the
   signal the loss asked for (or the schedule had it scored ahead);
3. the student minimises the loss on response tokens, normalised over the whole global
   batch, with gradient accumulation over micro-batches and one optimizer step; a
   teacher that follows the student (an EMA of its weights) then takes the update
   (:meth:`~opd.models.interfaces.TeacherInterface.follow_student`, a no-op for the others);
4. the step's metrics and the time of each phase are returned to the training loop,
   which logs them, validates every ``val_freq`` steps and checkpoints every
   ``save_freq`` steps (:mod:`opd.run.training_loop`, shared with SFT).

The driver calls only the interfaces of :mod:`opd.models.interfaces`, as NeMo-RL's
``grpo_train`` does; :func:`opd.distillation.setup.setup` builds the backends
and :mod:`opd.distillation.config` holds the config.
"""

from __future__ import annotations

import functools
import logging
import random
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.batches import unique_responses_per_prompt
from opd.distillation.config import MasterConfig
from opd.distillation.schedule import RolloutSchedule, ScheduledBatch, signal_rows
from opd.distillation.setup import DistillationComponents
from opd.models.interfaces import (
    Done,
    GenerationInterface,
    MicroBatchScorer,
    Pending,
    TeacherInterface,
    TeacherSignal,
    TimedPending,
)
from opd.rollout.multi_turn import Episodes
from opd.run.training_loop import NextBatch, RunSaveState, TrainingCallbacks, run_training_loop
from opd.run.validation import TeacherEngine, validate
from opd.utils.memory import peak_memory_mb
from opd.utils.timer import Timer

log = logging.getLogger("opd")

DistillationSaveState = RunSaveState
"""Counters saved in every checkpoint (see :class:`~opd.run.training_loop.RunSaveState`)."""

_CONSOLE_KEYS = (
    "train/loss",
    "train/kl_forward",
    "train/kl_reverse",
    "train/kl_reverse_estimate",
    "train/on_policy",
    "train/mean_response_length",
    "perf/tokens_per_s",
)


def step_metrics(
    train_metrics: dict[str, float],
    scheduled: ScheduledBatch,
    seconds: dict[str, float],
    samples_per_prompt: int = 1,
    asynchronous: bool = False,
) -> dict[str, Any]:
    """A step's logged metrics: the trainer's (``train/*``), the batch's, and each phase's time.

    ``timing/training`` excludes the teacher, which is scored inside the trainer's
    micro-batch loop and reported as ``timing/teacher``, and a distributed trainer's
    ``timing/dispatch`` (planning each rank's micro-batches). A distributed trainer also
    reports ``timing/trainer_compute``: the slowest rank's own time in the step, part of
    ``timing/training`` (the rest is the cost of calling the workers). On-policy steps also log
    ``train/unique_responses_per_prompt`` (out of ``samples_per_prompt``) and
    ``train/sampled_version``.

    An asynchronous schedule logs, instead of ``timing/generation``, what the step waited
    for: ``timing/wait_prev_gen`` (the rollout started earlier),
    ``timing/wait_prev_teacher`` (the teacher's score started earlier) and
    ``timing/sync_rollout_weights`` (the weight sync to the rollout engine), and for
    on-policy steps ``train/staleness_mean`` / ``train/staleness_max`` (the policy-version
    lag of the step's samples).

    A step whose weight sync went to engines in other processes (rollout workers) also logs
    ``refit/bytes`` (one copy of the weights, in the engines' dtype) and
    ``refit/bytes_delivered`` (what the engines received, one copy per worker).
    """
    batch = scheduled.batch
    metrics: dict[str, Any] = {f"train/{key}": value for key, value in train_metrics.items()}
    metrics["train/on_policy"] = int(scheduled.on_policy)
    if scheduled.on_policy:
        metrics["train/unique_responses_per_prompt"] = unique_responses_per_prompt(batch, samples_per_prompt)
        metrics["train/sampled_version"] = scheduled.sampled_version
        if asynchronous:
            # A batch is sampled from one version, so its lag is one number; mean and max keep their
            # meaning if samples ever mix versions.
            metrics["train/staleness_mean"] = float(scheduled.staleness or 0)
            metrics["train/staleness_max"] = scheduled.staleness or 0
    if "task_reward" in batch:
        metrics["train/task_reward"] = float(batch["task_reward"].mean())
    metrics["train/mean_response_length"] = float(batch["response_lengths"].float().mean())
    metrics["train/truncation_rate"] = float(batch["truncated"].float().mean())
    if asynchronous:
        for phase in ("wait_prev_gen", "wait_prev_teacher", "sync_rollout_weights"):
            metrics[f"timing/{phase}"] = seconds.get(phase, 0.0)
    else:
        if "refit" in seconds:
            metrics["timing/refit"] = seconds["refit"]
        metrics["timing/generation"] = seconds.get("generation", 0.0)
    metrics["timing/teacher"] = seconds.get("teacher", 0.0)
    # A distributed trainer's own timings, and each of several teachers' (teacher/<name>).
    known = {"step", "training", "teacher", "generation", "refit", "wait_prev_gen", "wait_prev_teacher"}
    for phase in sorted(set(seconds) - known - {"sync_rollout_weights"}):
        metrics[f"timing/{phase}"] = seconds[phase]
    metrics.update(scheduled.refit_metrics)  # the bytes the step's weight sync moved
    metrics.update(scheduled.rollout_metrics)  # a multi-turn rollout's episodes (env/...)
    metrics["timing/training"] = seconds["training"] - seconds.get("teacher", 0.0) - seconds.get("dispatch", 0.0)
    metrics["timing/step"] = seconds["step"]
    metrics["perf/tokens_per_s"] = float(batch["input_lengths"].sum()) / seconds["step"]
    metrics["perf/peak_memory_mb"] = peak_memory_mb()
    return metrics


def distillation_train(components: DistillationComponents) -> None:
    """Runs on-policy distillation until ``max_num_steps`` or ``num_epochs`` is reached.

    If the components' save state comes from a checkpoint (step > 0), the RNG streams,
    the λ coin and the data position are restored from that checkpoint first, so the
    remaining steps are exactly those of an uninterrupted run. SIGINT / SIGTERM finish
    the current step, write a checkpoint and return.

    Raises:
        TrainingDivergedError: after ``max_consecutive_nonfinite_steps`` skipped steps.
    """
    run_training_loop(components.run_parts(), DistillationRun(components))


class DistillationRun(TrainingCallbacks):
    """One distillation run: its components, its rollout schedule, and the step the training loop calls.

    Args:
        components: what :func:`~opd.distillation.setup.setup` built.
    """

    console_keys = _CONSOLE_KEYS

    def __init__(self, components: DistillationComponents) -> None:
        self.parts = components
        config = components.master_config
        self.config = config
        self.lambda_coin = random.Random(config.training.seed + 1)
        """The λ coin: a dedicated, checkpointed RNG."""
        self.schedule = RolloutSchedule(
            config.training.scheduler,
            components.student_generation,
            components.teacher_policy,
            components.student_policy,
            components.loss_fn,
            components.tokenizer,
            config,
            self.lambda_coin,
            sampler_logprobs=any(config.training.correction_is_on(loss) for _, loss in config.teacher_losses()),
        )
        self.policy_version = components.distillation_save_state["step"]
        """Optimizer steps taken so far: the version of the weights being trained."""

    def train_step(self, next_batch: NextBatch) -> tuple[int, dict[str, Any]]:
        """One optimizer step: the schedule's batch (rollout or fixed data) → teacher → train.

        Returns:
            The number of prompts trained and the step's metrics.
        """
        student, teacher, loss_fn = self.parts.student_policy, self.parts.teacher_policy, self.parts.loss_fn
        timer = Timer()
        with timer.time("step"):
            scheduled = self.schedule.next_batch(next_batch, self.policy_version)
            request = loss_fn.teacher_request

            def submit(micro_batch: BatchedDataDict) -> Pending[TeacherSignal]:
                if scheduled.teacher_signal is not None:  # scored ahead, while an earlier step trained
                    return Done(signal_rows(scheduled.teacher_signal, micro_batch))
                assert request is not None  # passed to the trainer only when the loss asks for one
                # Starting and waiting both count as teacher time (a trainer may start all micro-batches first).
                with timer.time("teacher"):
                    pending = teacher.score_async(micro_batch, request)
                return TimedPending(pending, functools.partial(timer.time, "teacher"))

            with timer.time("training"):
                scorer = MicroBatchScorer(submit) if request is not None else None
                train_metrics = student.train(scheduled.batch, loss_fn, scorer, timer)
            # Before anything scores the next batch (or a checkpoint keeps the teacher's state).
            teacher.follow_student(student, self.policy_version + 1, timer)
            train_metrics = loss_fn.finish_metrics(train_metrics)
            self.policy_version += 1
        seconds = {**timer.pop(), **scheduled.seconds}
        # Each of several teachers' scoring time, which the loss reports.
        for key in [key for key in train_metrics if key.endswith("_seconds")]:
            phase = key.removesuffix("_seconds")
            seconds[phase] = seconds.get(phase, 0.0) + train_metrics.pop(key)
        samples_per_prompt = self.config.distillation.num_samples_per_prompt
        metrics = step_metrics(train_metrics, scheduled, seconds, samples_per_prompt, self.schedule.asynchronous)
        if self.config.distillation.lambda_is_scheduled():  # the λ this step's coin was flipped against
            metrics["train/lambda"] = self.config.distillation.lambda_at(self.policy_version)
        return len(scheduled.examples), metrics

    def _refresh_generation(self) -> None:
        # Validation samples too, from the weights just trained (rollouts in flight finish first).
        self.schedule.refresh_for_validation(self.policy_version)

    def validate(self) -> dict[str, float] | None:
        """The student's accuracy, lengths and KL to the teacher (:func:`validate`); None without data."""
        if self.parts.val_dataloader is None:
            return None
        self._refresh_generation()
        return validate(
            self.parts.student_generation,
            self.parts.student_policy,
            self.parts.teacher_policy,
            self.parts.val_dataloader,
            self.parts.tokenizer,
            self.config.validation.generate_strategy,
            self.config.validation.teacher_topk,
            loss_request=self.parts.loss_fn.teacher_request,
            episodes=Episodes.from_config(self.config.environment),
        )

    def before_first_step(self) -> dict[str, float]:
        """Once, on a fresh run: the teacher's answers (with its context, if any) and the eval baseline."""
        parts = self.parts
        if parts.val_dataloader is None or not parts.teacher_generation:
            return {}
        if self.config.validation.eval_baseline:  # the student answers too: from its current weights
            self._refresh_generation()
        metrics = validation_baselines(
            parts.student_generation, parts.teacher_generation, parts.val_dataloader, parts.tokenizer, self.config
        )
        if metrics:
            parts.logger.log_metrics(metrics, 0, console_keys=list(metrics))
        return metrics

    @property
    def algorithm_rng(self) -> random.Random:
        """The λ coin."""
        return self.lambda_coin

    @property
    def in_flight(self) -> RolloutSchedule:
        """The rollout schedule: batches sampled (and scored) ahead of their step."""
        return self.schedule

    @property
    def teacher_state(self) -> TeacherInterface:
        """The teacher, whose state (an EMA teacher's average) is checkpointed with the run."""
        return self.parts.teacher_policy


def validation_baselines(
    student_generation: GenerationInterface,
    teacher_generation: list[TeacherEngine],
    val_dataloader: StatefulDataLoader,
    tokenizer: Any,
    config: MasterConfig,
) -> dict[str, float]:
    """``validation.teacher_baseline`` / ``eval_baseline``: how teacher and student answer before training.

    Each teacher answers with its teacher-only context, if any, and in its own tokens (a
    cross-tokenizer teacher decodes and is graded with its own tokenizer). With several
    teachers each is measured on its own (:class:`TeacherEngine`): with routing on the
    prompts routed to it, in a mixture on every prompt; its metrics are
    ``val/teacher_<name>_*``. The eval baseline compares the student as it starts, without
    the context, with each teacher on that teacher's prompts
    (``val/baseline_student_accuracy``, ``val/baseline_teacher_accuracy`` and
    ``val/baseline_accuracy_gap``; with several teachers ``..._<name>`` at the end of each).
    Each teacher's engine is closed once it has answered: rollout workers that loaded a
    teacher's weights for it free them before the next teacher loads.
    """
    if not (config.validation.teacher_baseline or config.validation.eval_baseline):
        return {}
    strategy = config.validation.generate_strategy
    episodes = Episodes.from_config(config.environment)  # with an environment, each answers in episodes
    metrics: dict[str, float] = {}
    for engine in teacher_generation:
        prefix = "val/teacher_" if engine.name is None else f"val/teacher_{engine.name}_"
        try:
            teacher_metrics = validate(
                engine.generation,
                None,
                None,
                val_dataloader,
                engine.tokenizer,
                strategy,
                prefix=prefix,
                prompt_key=engine.prompt_key,
                keep=engine.answers,
                episodes=episodes,
            )
        finally:
            engine.generation.close()
        if config.validation.teacher_baseline:
            metrics.update(teacher_metrics)
        if not config.validation.eval_baseline:
            continue
        student_metrics = validate(
            student_generation,
            None,
            None,
            val_dataloader,
            tokenizer,
            strategy,
            prefix="val/student_",
            keep=engine.answers,
            episodes=episodes,
        )
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
