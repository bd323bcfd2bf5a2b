"""On-policy distillation: the driver's step, and the rollout schedule that supplies each step's batch.

One optimizer step (:meth:`DistillationRun.train_step`, walked through in ``docs/guide/``):

1. :meth:`RolloutSchedule.next_batch` hands over the batch: with probability ``lambda`` (the λ coin, a checkpointed
   RNG flipped when the batch was started) the student's own samples, ``num_samples_per_prompt`` per prompt, else
   the dataset's assistant turn;
2. the teacher scores the same token ids per micro-batch with the signal the loss asks for (unless scored ahead, or
   a fixed-data batch whose signal ``opd generate`` stored: :mod:`opd.distillation.cached_teacher_signal`);
3. the student takes one optimizer step on the loss over response tokens, normalised over the global batch; a
   teacher that follows the student (an EMA of its weights) then takes the update;
4. the metrics go back to :mod:`opd.run.training_loop`, which logs, validates and checkpoints.

``training.scheduler`` says what runs while the student trains. Policy version ``v`` = optimizer steps taken;
step ``t`` updates version ``t − 1`` to ``t``:

* ``sync`` (depth 0): step t's rollout is sampled at the start of step t; nothing overlaps.
* ``one_step_off`` (1): during update t the engine samples batch t + 1 with version t − 1; the weight sync
  happens while the teacher scores batch t.
* ``two_step_off`` (2): during update t the engine samples batch t + 2 and the teacher scores batch t + 1 (a
  full-vocabulary loss as final hidden states); samples are two steps stale.

``staleness`` is ``v − sampled_version``. In one process the phases run one after another and draw the same
samples. Checkpoints keep the batches in flight, so a resumed run trains the samples the uninterrupted run would.
The driver calls only :mod:`opd.models.interfaces`; :func:`opd.distillation.setup.setup` builds the backends.
"""

from __future__ import annotations

import functools
import random
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.batches import attach_teacher_fields, build_fixed_data_batch, unique_responses_per_prompt
from opd.data.dataloaders import PreparedExample
from opd.data.sequences import build_token_mask
from opd.distillation.baselines import validation_baselines
from opd.distillation.cached_teacher_signal import FixedDataSignals, open_fixed_data_signals
from opd.distillation.config import DEPTHS, MasterConfig
from opd.distillation.setup import DistillationComponents
from opd.models.interfaces import (
    Done,
    FullVocabRequest,
    GenerationInterface,
    LossFunction,
    MicroBatchScorer,
    Pending,
    PerTeacherRequest,
    PolicyInterface,
    TeacherInterface,
    TeacherSignal,
    TimedPending,
)
from opd.rollout.environments.math_verifier import grade_responses
from opd.rollout.multi_turn import Episodes, MultiTurnRollout
from opd.run.training_loop import NextBatch, TrainingCallbacks, run_training_loop
from opd.run.validation import validate
from opd.teachers.several_teachers import MixedSignal
from opd.teachers.signals import holds_hidden_states, signal_from_state, signal_rows, signal_to_state
from opd.utils.errors import ConfigError
from opd.utils.memory import peak_memory_mb
from opd.utils.timer import Timer


def step_metrics(
    train_metrics: dict[str, float],
    scheduled: ScheduledBatch,
    seconds: dict[str, float],
    samples_per_prompt: int = 1,
    asynchronous: bool = False,
) -> dict[str, Any]:
    """A step's logged metrics: the trainer's (``train/*``), the batch's, and each phase's time.

    ``timing/training`` excludes ``timing/teacher`` (scored inside the trainer's micro-batch loop) and a distributed
    trainer's ``timing/dispatch``; ``timing/trainer_compute`` is the slowest rank's own part of it. An asynchronous
    schedule logs what the step waited for (``timing/wait_prev_*``, ``timing/sync_rollout_weights``) instead of
    ``timing/generation``. ``refit/bytes`` is one copy of the weights in the engines' dtype, ``refit/bytes_delivered``
    one copy per rollout worker.
    """
    batch = scheduled.batch
    metrics: dict[str, Any] = {f"train/{key}": value for key, value in train_metrics.items()}
    metrics["train/on_policy"] = int(scheduled.on_policy)
    if scheduled.on_policy:
        metrics["train/unique_responses_per_prompt"] = unique_responses_per_prompt(batch, samples_per_prompt)
        metrics["train/sampled_version"] = scheduled.sampled_version
        if asynchronous:
            # One version per batch, so one lag; mean and max keep their meaning if samples ever mix versions.
            metrics["train/staleness_mean"] = float(scheduled.staleness or 0)
            metrics["train/staleness_max"] = scheduled.staleness or 0
    if "task_reward" in batch:
        reward = batch["task_reward"]
        if reward.dim() == 2:  # per token (multi-turn returns): the mean over the student's tokens
            mask = batch["token_mask"]
            metrics["train/task_reward"] = float((reward * mask).sum() / mask.sum().clamp(min=1))
        else:
            metrics["train/task_reward"] = float(reward.mean())
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

    A resumed run (save state at step > 0) restores the RNG streams, the λ coin and the data position first, so
    it takes the uninterrupted run's steps. SIGINT / SIGTERM finish the step, write a checkpoint and return.

    Raises:
        TrainingDivergedError: after ``max_consecutive_nonfinite_steps`` skipped steps.
    """
    run_training_loop(components.run_parts(), DistillationRun(components))


class DistillationRun(TrainingCallbacks):
    """One distillation run: its components (from :func:`~opd.distillation.setup.setup`), schedule and step."""

    console_keys = (
        "train/loss",
        "train/kl_forward",
        "train/kl_reverse",
        "train/kl_reverse_estimate",
        "train/on_policy",
        "train/mean_response_length",
        "perf/tokens_per_s",
    )

    def __init__(self, components: DistillationComponents) -> None:
        self.parts = components
        config = components.master_config
        self.config = config
        train_examples = cast("list[PreparedExample]", components.dataloader.dataset)  # the loader's own list
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
            fixed_data_signals=open_fixed_data_signals(config, components.loss_fn.teacher_request, train_examples),
        )
        self.policy_version = components.distillation_save_state["step"]
        """Optimizer steps taken so far: the version of the weights being trained."""

    def train_step(self, next_batch: NextBatch) -> tuple[int, dict[str, Any]]:
        """One optimizer step (the schedule's batch → teacher → train); returns ``(prompts trained, metrics)``."""
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
                step_loss = loss_fn.for_step(self.policy_version + 1)
                train_metrics = student.train(scheduled.batch, step_loss, scorer, timer)
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

    def validate(self) -> dict[str, float] | None:
        """The student's accuracy, lengths and KL to the teacher (:func:`validate`); None without data."""
        if self.parts.val_dataloader is None:
            return None
        # Validation samples too, from the weights just trained (rollouts in flight finish first).
        self.schedule.refresh_for_validation(self.policy_version)
        return validate(
            self.parts.student_generation,
            self.parts.student_policy,
            self.parts.teacher_policy,
            self.parts.val_dataloader,
            self.parts.tokenizer,
            self.config.validation.generate_strategy,
            self.config.validation.teacher_topk,
            loss_request=self.parts.loss_fn.teacher_request,
            episodes=self.schedule.episodes,  # the environment built once, with its tools
        )

    def before_first_step(self) -> dict[str, float]:
        """Once, on a fresh run: the teacher's answers (with its context, if any) and the eval baseline."""
        parts = self.parts
        if parts.val_dataloader is None or not parts.teacher_generation:
            return {}
        if self.config.validation.eval_baseline:  # the student answers too: from its current weights
            self.schedule.refresh_for_validation(self.policy_version)
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


# ---------------------------------------------------------------- where each step's batch comes from

NextExamples = Callable[[], list[PreparedExample]]
"""Draws the next batch of prompts from the training data (across epochs)."""


@dataclass
class ScheduledBatch:
    """One step's training input, as the schedule hands it to the driver.

    Attributes:
        batch: with ``token_mask`` (and ``task_reward``, ``staleness``, ``sample_index`` where they apply).
        sampled_version, staleness: the rollout's policy version, and steps since (None for fixed data).
        teacher_signal: the whole batch's signal when scored ahead, else None (the trainer scores each micro-batch).
        seconds: the controller's time on this step's inputs, by phase.
        refit_metrics: ``refit/bytes`` and ``refit/bytes_delivered``, summed over the step's weight syncs.
        rollout_metrics: a multi-turn rollout's episode metrics (``env/...``).
    """

    batch: BatchedDataDict
    examples: list[PreparedExample]
    on_policy: bool
    sampled_version: int | None
    staleness: int | None
    teacher_signal: TeacherSignal | None
    seconds: dict[str, float]
    refit_metrics: dict[str, float] = field(default_factory=dict)
    rollout_metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Slot:
    """A batch started but not yet trained."""

    examples: list[PreparedExample]
    on_policy: bool
    sampled_version: int | None
    rollout: Pending[Any] | Future[Any] | None = None  # running or done (a Future: on a thread); None once collected
    finish: Callable[[Any], BatchedDataDict] | None = None  # makes the collected rollout a training batch
    batch: BatchedDataDict | None = None  # the collected training batch
    teacher: Pending[TeacherSignal] | None = None
    teacher_signal: TeacherSignal | None = None
    teacher_started: bool = False
    rollout_metrics: dict[str, float] = field(default_factory=dict)  # a multi-turn rollout's episode metrics


class RolloutSchedule:
    """Starts rollouts and teacher scores ahead of the update, as ``training.scheduler`` says.

    ``policy`` is the source of every weight sync; ``lambda_coin`` is checkpointed by the training loop.
    ``sampler_logprobs`` asks the engine for the sampler's log-probs even when the loss does not read them
    (the off-policy correction and its metrics do). ``fixed_data_signals`` gives fixed-data batches their teacher
    signal from a cache, where it holds every row; the teacher scores the others.
    """

    def __init__(
        self,
        scheduler: str,
        generation: GenerationInterface,
        teacher: TeacherInterface,
        policy: PolicyInterface,
        loss_fn: LossFunction,
        tokenizer: Any,
        config: MasterConfig,
        lambda_coin: Any,
        sampler_logprobs: bool = False,
        fixed_data_signals: FixedDataSignals | None = None,
    ) -> None:
        self.depth = DEPTHS[scheduler]
        self.fixed_data_signals = fixed_data_signals
        self.generation, self.teacher, self.policy = generation, teacher, policy
        self.loss_fn, self.tokenizer, self.config, self.lambda_coin = loss_fn, tokenizer, config, lambda_coin
        self.return_logprobs = loss_fn.needs_sampler_logprobs or sampler_logprobs
        request = loss_fn.teacher_request
        # Top-k and token signals are small enough to score a whole batch ahead; the full vocabulary is scored by
        # the trainer per micro-batch, unless two_step_off scores the next batch during the update. Routed teachers
        # of which one asks for the full vocabulary score at the step.
        full_vocab = isinstance(request, FullVocabRequest)
        routes_full_vocab = isinstance(request, PerTeacherRequest) and any(
            isinstance(part, FullVocabRequest) for part in request.requests
        )
        self.scores_ahead = (
            self.depth > 0 and request is not None and not routes_full_vocab and (self.depth == 2 or not full_vocab)
        )
        # A whole batch's full vocabulary is scored ahead as final hidden states, never as logits.
        self.ahead_request = FullVocabRequest(prefer_hidden_states=True) if full_vocab else request
        self.queue: deque[_Slot] = deque()
        self.rollout_version: int | None = None
        """The policy version the engine's weights are (None: not known, refit before sampling)."""
        self.refit_metrics: dict[str, float] = {}
        """What the weight syncs timed for the step being prepared moved (handed to its :class:`ScheduledBatch`)."""
        self.episodes = Episodes.from_config(config.environment)
        """Multi-turn rollouts' environment and limits (``environment:``), or None for one turn per rollout."""
        self._episodes: ThreadPoolExecutor | None = None
        """Runs multi-turn rollouts in the background (asynchronous schedules, engines in other processes)."""
        self._episodes_in_flight: list[Future[Any]] = []

    @property
    def asynchronous(self) -> bool:
        """Whether rollouts are sampled ahead of the update."""
        return self.depth > 0

    @property
    def ahead(self) -> int:
        """Batches drawn from the data but not yet trained."""
        return len(self.queue)

    # ------------------------------------------------------------------ the step

    def next_batch(self, next_examples: NextExamples, version: int) -> ScheduledBatch:
        """The batch to train at policy version ``version`` (steps taken), after starting the rollouts due now."""
        timer = Timer()
        if not self.queue:  # sync, or the first step of an asynchronous run
            self.queue.append(self._start(next_examples(), version, timer))
        current = self.queue[0]
        self._collect(current, timer)
        if self.depth == 2:
            if len(self.queue) < 2:  # warm-up: the second batch, with the initial weights too
                self.queue.append(self._start(next_examples(), version, timer))
            self._collect(self.queue[1], timer)  # its teacher now scores while the student trains
        while len(self.queue) < self.depth + 1:  # sampled with the weights of now, trained later
            self.queue.append(self._start(next_examples(), version, timer))
        teacher_signal = None
        if current.teacher is not None:
            with timer.time("wait_prev_teacher"):
                teacher_signal = current.teacher.result()
            current.teacher = None
        elif current.teacher_signal is not None:  # read from the teacher-signal cache, or restored from a checkpoint
            teacher_signal = current.teacher_signal
        self.queue.popleft()
        assert current.batch is not None  # collected above
        return self._scheduled(current, version, teacher_signal, timer.pop())

    def sync_weights(self, version: int, timer: Timer | None = None) -> None:
        """Loads the policy's weights (version ``version``) into the engine, if it holds others (timed for a step)."""
        if not self.generation.needs_refit or self.rollout_version == version:
            return
        with (timer or Timer()).time("sync_rollout_weights" if self.asynchronous else "refit"):
            # A multi-turn rollout samples every turn with the weights it started with: refit once its episodes end.
            for episodes in self._episodes_in_flight:
                episodes.result()
            self._episodes_in_flight.clear()
            moved = self.generation.refit(self.policy)
        self.rollout_version = version
        if timer is not None:
            for name, value in moved.items():
                self.refit_metrics[name] = self.refit_metrics.get(name, 0.0) + value

    def refresh_for_validation(self, version: int) -> None:
        """Before validation samples: rollouts in flight finish (and are kept), then the engine gets ``version``."""
        self._drain()
        self.sync_weights(version)

    def _start(self, examples: list[PreparedExample], version: int, timer: Timer) -> _Slot:
        """Flips the λ coin of the optimizer step the batch will train (its place in the queue says which) and starts
        its rollout (synced to ``version`` first) or builds its fixed data."""
        distillation = self.config.distillation
        step = version + 1 + len(self.queue)
        on_policy = self.lambda_coin.random() < distillation.lambda_at(step)
        if not on_policy:
            batch = build_fixed_data_batch(examples, self.tokenizer.pad_token_id, distillation.mask_prompt_tokens)
            slot = _Slot(examples, False, None, batch=batch)
            if self.fixed_data_signals is not None:
                with timer.time("teacher_cache"):
                    slot.teacher_signal = self.fixed_data_signals.signal_for(examples, batch["input_ids"].shape[1])
            self._start_teacher(slot)
            return slot
        self.sync_weights(version, timer)
        if self.episodes is not None:
            return self._start_multi_turn(examples, version, timer)
        start = time.perf_counter()
        rollout = self.generation.generate_async(
            [example["prompt_ids"] for example in examples],
            distillation.generate_strategy,
            distillation.num_samples_per_prompt,
            return_logprobs=self.return_logprobs,
        )
        if not self.asynchronous:
            # In sync the rollout is the step's generation phase: it is collected at once.
            slot = _Slot(examples, True, version, batch=self._finish_rollout(rollout.result(), examples))
            timer.add("generation", time.perf_counter() - start)
            return slot
        return _Slot(examples, True, version, rollout=rollout, finish=lambda raw: self._finish_rollout(raw, examples))

    def _start_multi_turn(self, examples: list[PreparedExample], version: int, timer: Timer) -> _Slot:
        """Starts a multi-turn rollout (:mod:`opd.rollout.multi_turn`); its batch is built when it is collected.

        Each turn is a ``generate`` call, so any engine serves it. Asynchronous with rollout workers, the episodes
        run on a background thread beside the update (no refit until they end); otherwise they run to the end now.
        """
        assert self.episodes is not None
        if any("prompt_messages" not in example for example in examples):
            raise ValueError("multi-turn rollouts need each example's prompt_messages (prepare_examples with tools)")
        slot = _Slot(examples, True, version, finish=lambda raw: self._finish_multi_turn(raw, slot))
        if self.asynchronous and self.generation.samples_elsewhere:
            if self._episodes is None:
                self._episodes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opd-episodes")
            future = self._episodes.submit(self._run_episodes, examples)
            self._episodes_in_flight.append(future)
            slot.rollout = future
            return slot
        start = time.perf_counter()
        slot.batch = self._finish_multi_turn(self._run_episodes(examples), slot)
        rollout_seconds = time.perf_counter() - start
        environment_seconds = slot.rollout_metrics.pop("timing/environment", 0.0)
        timer.add("environment", environment_seconds)
        timer.add("generation", rollout_seconds - environment_seconds)
        self._start_teacher(slot)
        return slot

    def _run_episodes(self, examples: list[PreparedExample]) -> MultiTurnRollout:
        """The episodes of ``examples``, turn by turn, with the engine switched on around them."""
        assert self.episodes is not None
        distillation = self.config.distillation
        self.generation.prepare_for_generation()
        try:
            return self.episodes.rollout(
                self.generation,
                self.tokenizer,
                examples,
                distillation.generate_strategy,
                distillation.num_samples_per_prompt,
                self.return_logprobs,
            )
        finally:
            self.generation.finish_generation()

    def _finish_multi_turn(self, rollout: MultiTurnRollout, slot: _Slot) -> BatchedDataDict:
        """A multi-turn rollout made a training batch (its own mask kept); its episode metrics go on the slot."""
        slot.rollout_metrics = rollout.metrics()
        batch = rollout.batch
        attach_teacher_fields(batch, slot.examples, self.config.distillation.num_samples_per_prompt)
        if self.loss_fn.needs_task_reward:
            batch["task_reward"] = rollout.task_rewards()
        return batch

    def _collect(self, slot: _Slot, timer: Timer) -> None:
        """Waits for a slot's rollout (timed as ``wait_prev_gen``) and starts its teacher."""
        if slot.rollout is not None:
            with timer.time("wait_prev_gen"):
                raw = slot.rollout.result()
            assert slot.finish is not None  # every started rollout has one
            slot.batch = slot.finish(raw)
            slot.rollout = None
            environment_seconds = slot.rollout_metrics.pop("timing/environment", None)
            if environment_seconds is not None:  # spent in the background thread, beside the update
                timer.add("environment", environment_seconds)
        self._start_teacher(slot)

    def _start_teacher(self, slot: _Slot) -> None:
        """Starts scoring a collected batch ahead of its step, if the schedule does and it has no signal yet."""
        if self.scores_ahead and not slot.teacher_started and slot.teacher_signal is None and slot.batch is not None:
            request = self.ahead_request
            assert request is not None  # scores_ahead implies a request
            slot.teacher = self.teacher.score_async(slot.batch, request)
            slot.teacher_started = True

    def _finish_rollout(self, batch: BatchedDataDict, examples: list[PreparedExample]) -> BatchedDataDict:
        """A rollout made a training batch: its loss mask, the teacher's prompts, a task reward."""
        distillation = self.config.distillation
        batch["token_mask"] = build_token_mask(
            batch["input_lengths"],
            batch["prompt_lengths"],
            batch["input_ids"].shape[1],
            distillation.mask_prompt_tokens,
        )
        attach_teacher_fields(batch, examples, distillation.num_samples_per_prompt)
        if self.loss_fn.needs_task_reward:
            batch["task_reward"] = task_rewards(batch, examples, distillation.num_samples_per_prompt, self.tokenizer)
        return batch

    def _scheduled(
        self, slot: _Slot, version: int, teacher_signal: TeacherSignal | None, seconds: dict[str, float]
    ) -> ScheduledBatch:
        batch = slot.batch
        assert batch is not None
        staleness = version - slot.sampled_version if slot.sampled_version is not None else None
        if staleness is not None and self.asynchronous:
            batch["staleness"] = torch.full((batch.size,), staleness, dtype=torch.long)
        if teacher_signal is not None:
            batch["sample_index"] = torch.arange(batch.size)  # micro-batches find their rows of the signal
        refit_metrics, self.refit_metrics = self.refit_metrics, {}
        return ScheduledBatch(
            batch,
            slot.examples,
            slot.on_policy,
            slot.sampled_version,
            staleness,
            teacher_signal,
            seconds,
            refit_metrics,
            slot.rollout_metrics,
        )

    def _drain(self) -> None:
        """Collects every rollout and teacher score in flight (results are kept for their steps)."""
        for slot in self.queue:
            self._collect(slot, Timer())
            if slot.teacher is not None:
                slot.teacher_signal = slot.teacher.result()
                slot.teacher = None

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The batches in flight, collected, as plain tensors and lists (``torch.load(weights_only=True)``)."""
        self._drain()
        return {
            "depth": self.depth,
            "slots": [
                {
                    "examples": slot.examples,
                    "on_policy": slot.on_policy,
                    "sampled_version": slot.sampled_version,
                    "batch": dict(slot.batch) if slot.batch is not None else None,
                    "rollout_metrics": slot.rollout_metrics,
                    **_teacher_state(slot),
                }
                for slot in self.queue
            ],
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restores a checkpoint's batches in flight; ConfigError if made under another ``training.scheduler``."""
        self.queue.clear()
        self.rollout_version = None
        if state is None or not state["slots"]:
            return
        if state["depth"] != self.depth:
            names = {depth: name for name, depth in DEPTHS.items()}
            raise ConfigError(
                f"the checkpoint was written with training.scheduler = {names[state['depth']]} and has batches "
                f"in flight; resume it with that scheduler (this run has {names[self.depth]})"
            )
        for saved in state["slots"]:
            slot = _Slot(saved["examples"], saved["on_policy"], saved["sampled_version"])
            slot.batch = BatchedDataDict(saved["batch"]) if saved["batch"] is not None else None
            slot.teacher_signal = signal_from_state(saved["teacher_signal"])
            slot.teacher_started = saved["teacher_started"]
            slot.rollout_metrics = saved.get("rollout_metrics", {})
            self.queue.append(slot)


def _teacher_state(slot: _Slot) -> dict[str, Any]:
    """A slot's teacher signal for a checkpoint; hidden states or an unmixed mixture are left out (scored on resume)."""
    signal = slot.teacher_signal
    unmixed = isinstance(signal, MixedSignal) and signal.mixed is None
    if holds_hidden_states(signal) or unmixed:
        return {"teacher_signal": None, "teacher_started": False}
    return {"teacher_signal": signal_to_state(signal), "teacher_started": slot.teacher_started}


def task_rewards(
    batch: BatchedDataDict, examples: list[PreparedExample], num_samples: int, tokenizer: Any
) -> torch.Tensor:
    """``[N]`` task reward of each sampled response: 1.0 if the math verifier accepts it, else 0."""
    ground_truths = [examples[row // num_samples]["ground_truth"] for row in range(batch.size)]  # samples adjacent
    grades = grade_responses(
        batch["input_ids"], batch["prompt_lengths"], batch["input_lengths"], ground_truths, tokenizer
    )
    return torch.tensor([float(grade is True) for grade in grades], dtype=torch.float32)
