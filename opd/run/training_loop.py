"""The run lifecycle shared by every algorithm: steps, validation, checkpoints, resume, stop.

``distillation_train`` and ``sft_train`` differ only in what one step does (:class:`TrainingCallbacks`); resume
(RNG streams, data position, truncated logs), epochs, the non-finite guard, periodic validation and checkpoints,
early stopping (:mod:`opd.run.early_stop`), SIGINT / SIGTERM and the atomic ``final_model/`` live here, once.
"""

from __future__ import annotations

import logging
import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypedDict

import yaml
from pydantic import BaseModel, Field, model_validator
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from opd.models.config import ModelLoadingConfig, OptimizerConfig
from opd.models.interfaces import PolicyInterface
from opd.run.checkpoint import (
    CheckpointingConfig,
    CheckpointManager,
    publish_directory,
    reading_checkpoint,
    staging_directory,
)
from opd.run.early_stop import (
    TEACHER_PREFIX,
    EarlyStopConfig,
    EarlyStopState,
    fresh_early_stop_state,
    observe,
)
from opd.run.harness import HarnessResults, evaluate_with_harness, load_for_harness
from opd.run.logger import Logger, flatten_dict
from opd.run.model_card import CARD_FILENAME, last_validation, render_model_card
from opd.run.plotting import read_metrics
from opd.run.validation import ValidationConfig
from opd.utils.config import StrictConfig, config_to_yaml
from opd.utils.errors import ConfigError, ResumableError, TrainingDivergedError
from opd.utils.rng import capture_rng_state, restore_rng_state
from opd.utils.signals import GracefulStop

log = logging.getLogger("opd")


class TrainingLoopConfig(OptimizerConfig):
    """Run-length, cadence and safety settings that every algorithm's ``training`` section shares."""

    num_epochs: int = Field(1, ge=1, description="passes over the training data")
    max_num_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    max_train_time_s: float | None = Field(
        None,
        gt=0,
        description="end the run once its optimizer steps (not validation or checkpoints) have taken this "
        "many seconds; for equal-compute comparisons. The learning-rate schedule still follows max_num_steps",
    )
    val_freq: int = Field(0, ge=0, description="validate every N steps; 0 disables periodic validation")
    save_freq: int = Field(0, ge=0, description="checkpoint every N steps; 0 saves only at the end")
    max_consecutive_nonfinite_steps: int = Field(
        5, ge=1, description="stop after this many steps in a row with a NaN/inf loss or gradient"
    )
    early_stop: EarlyStopConfig | None = Field(
        None,
        description="end the run when a validation metric stops improving or reaches a target; null = off",
    )
    seed: int = 42


class RunSaveState(TypedDict):
    """Counters saved in every checkpoint (``save_state.json``) and restored on resume."""

    step: int
    epoch: int
    consumed_samples: int
    best_metric: float | None
    best_step: int | None
    consecutive_nonfinite_steps: int
    train_time_s: float
    """Seconds spent in optimizer steps (validation and checkpoints excluded)."""
    early_stop: EarlyStopState
    """Kept also while ``training.early_stop`` is off."""


def fresh_save_state() -> RunSaveState:
    """The save state of a run that has not taken a step yet."""
    return {
        "step": 0,
        "epoch": 0,
        "consumed_samples": 0,
        "best_metric": None,
        "best_step": None,
        "consecutive_nonfinite_steps": 0,
        "train_time_s": 0.0,
        "early_stop": fresh_early_stop_state(),
    }


class RunConfig(StrictConfig):
    """The sections every algorithm's config shares, which the training loop reads."""

    output_dir: str
    training: TrainingLoopConfig
    validation: ValidationConfig
    checkpointing: CheckpointingConfig

    @abstractmethod
    def has_validation_data(self) -> bool:
        """Whether the run names validation data (in each algorithm's own ``data`` section)."""

    def validation_metrics(self) -> tuple[str, ...]:
        """The metrics this algorithm's validation reports (without a teacher: no KL)."""
        return ("val/accuracy", "val/mean_response_length", "val/truncation_rate")

    def teacher_target_problem(self) -> str | None:
        """Why ``training.early_stop.target = teacher`` has no teacher value to reach, or None."""
        return (
            "training.early_stop.target = teacher compares with a teacher's validation, which this run has "
            "none of; give a number"
        )

    @abstractmethod
    def model_loading(self) -> ModelLoadingConfig:
        """How this run loads its models (dtype, device): the external harness loads the final model so too."""

    def harness_comparisons(self) -> dict[str, str]:
        """The models ``validation.harness.compare`` may name beside the final model, by label (none by default)."""
        return {}

    @model_validator(mode="after")
    def _check_harness_comparisons(self) -> RunConfig:
        """Each model ``validation.harness.compare`` names must be one this run has."""
        available = self.harness_comparisons()
        missing = [name for name in self.validation.harness.compare if name not in available]
        if missing:
            raise ValueError(
                f"validation.harness.compare names {missing}, which this run has no model directory for "
                f"(it has {sorted(available) or 'none'})"
            )
        return self

    @model_validator(mode="after")
    def _check_early_stop(self) -> RunConfig:
        """``training.early_stop`` needs periodic validation and a metric (and teacher value) the run has."""
        rule = self.training.early_stop
        if rule is None:
            return self
        problem = rule.problem()
        if problem is None and rule.metric not in self.validation_metrics():
            problem = (
                f"training.early_stop.metric = {rule.metric} is not reported by this run's validation "
                f"({', '.join(self.validation_metrics())})"
            )
        if problem is None and self.training.val_freq == 0:
            problem = "training.early_stop acts at the periodic validations; set training.val_freq > 0"
        if problem is None and not self.has_validation_data():
            problem = (
                "training.early_stop watches validation, but there is no validation data; "
                "set data.val_path or data.val_holdout"
            )
        if problem is None and rule.targets_teacher:
            problem = self.teacher_target_problem()
        if problem is not None:
            raise ValueError(problem)
        return self


_WHY_UNREPORTED = {"val/accuracy": "; val/accuracy needs ground truth in the validation data"}
"""Why validation may not report a metric that early stopping watches, where there is a reason to give."""

NextBatch = Callable[[], list[Any]]
"""Draws the next batch of examples from the training data, across epochs."""

StepFn = Callable[[NextBatch], tuple[int, dict[str, Any]]]
"""One optimizer step, drawing the batches it needs; returns the examples trained and metrics (with
``train/skipped_nonfinite``)."""


class InFlight(Protocol):
    """Work an algorithm started ahead of its step (batches drawn, rollouts sampled), kept in checkpoints."""

    @property
    def ahead(self) -> int:
        """Batches drawn from the data but not yet trained."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What is in flight, complete (waits for it), for a checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restores a checkpoint's in-flight work (None: a checkpoint without any)."""
        ...


class TeacherState(Protocol):
    """A teacher whose weights change during the run (an EMA of the student's), kept in checkpoints."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep (empty: nothing, and no file is written)."""
        ...

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restores a checkpoint's state (None: the checkpoint kept none)."""
        ...


@dataclass
class RunParts:
    """What a run trains and where it writes; ``logger.total_steps`` is the run length, ``state`` updated in place."""

    policy: PolicyInterface
    tokenizer: Any
    dataloader: StatefulDataLoader
    logger: Logger
    checkpointer: CheckpointManager
    state: RunSaveState
    config: RunConfig


class TrainingCallbacks(ABC):
    """What an algorithm plugs into the shared loop: :meth:`train_step`, and optionally members that default to none."""

    console_keys: tuple[str, ...] = ()
    """Step metrics shown on the console."""

    @abstractmethod
    def train_step(self, next_batch: NextBatch) -> tuple[int, dict[str, Any]]:
        """One optimizer step, drawing the batches it needs (see :data:`StepFn`)."""

    def validate(self) -> dict[str, float] | None:
        """Runs validation and returns its ``val/*`` metrics; None when the run has no validation data."""
        return None

    def before_first_step(self) -> dict[str, float]:
        """Runs once on a fresh run before the start validation; its ``val/teacher_*`` are ``target: teacher``'s."""
        return {}

    @property
    def algorithm_rng(self) -> random.Random | None:
        """The algorithm's own generator (the λ coin), checkpointed with the rest."""
        return None

    @property
    def in_flight(self) -> InFlight | None:
        """Work started ahead of its step, checkpointed; the saved data position is then past the step."""
        return None

    @property
    def teacher_state(self) -> TeacherState | None:
        """The algorithm's teacher, whose state (if any) is checkpointed with the rest; None without a teacher."""
        return None


def run_training_loop(parts: RunParts, callbacks: TrainingCallbacks) -> None:
    """Drives a run from ``parts.state["step"]`` to ``parts.logger.total_steps``.

    Raises:
        TrainingDivergedError: after ``max_consecutive_nonfinite_steps`` skipped steps.
        ConfigError: validation (or the teacher baseline) did not report the metric ``training.early_stop`` watches.
        ResumableError: a distributed run lost a worker (WorkerError: names the role and rank) or a served teacher
            stayed down past its retries; the message names the newest complete checkpoint to resume from.
    """
    state, config, logger, checkpointer = parts.state, parts.config, parts.logger, parts.checkpointer
    run = _TrainingRun(parts, callbacks)
    if run.is_complete():
        run.finish_complete_run()
        return
    if state["step"] > 0:
        # Before anything is rewritten: a damaged checkpoint stops the run with the logs intact.
        run.restore_position()
    # Records past the resumed step belong to steps that are about to be re-run.
    logger.truncate_after(state["step"])
    if state["step"] == 0:
        run.note_baselines(callbacks.before_first_step())
        if config.validation.val_at_start:
            run.check_early_stop(run.validate(0), 0)
    else:
        run.check_teacher_target()
    try:
        with GracefulStop() as stop:
            while state["step"] < run.total_steps and not stop.requested:
                state["epoch"] = state["step"] // len(parts.dataloader)
                step_start = time.perf_counter()
                trained, metrics = callbacks.train_step(run.data.next)
                state["train_time_s"] += time.perf_counter() - step_start
                if run.after_step(trained, metrics):
                    break
            if stop.requested and state["step"] < run.total_steps:
                run.stop_on_signal(stop.signal_name)
                return
        run.finish()
    except ResumableError as error:
        # Nothing more can be saved: say what can be resumed. A served teacher that stayed down past its
        # retries used to stop the run with the client's message alone, which said neither where the run
        # stood nor that rerunning resumes it; it is told like a lost worker now.
        logger.close()
        latest = checkpointer.latest_checkpoint()
        where = f"the newest complete checkpoint is {latest}" if latest is not None else "no checkpoint was written"
        # The same error, its type and attributes kept (a WorkerError's role and rank), with the run's position.
        error.args = (
            f"{error} after step {state['step']} of {run.total_steps}; {where}; rerun the same command to resume",
        )
        raise error from None


class _TrainingRun:
    """The pieces of :func:`run_training_loop` around the step: counters, validation, checkpoints."""

    def __init__(self, parts: RunParts, callbacks: TrainingCallbacks) -> None:
        self.policy, self.tokenizer, self.dataloader = parts.policy, parts.tokenizer, parts.dataloader
        self.logger, self.checkpointer = parts.logger, parts.checkpointer
        self.state, self.config = parts.state, parts.config
        self.callbacks = callbacks
        self.algorithm_rng = callbacks.algorithm_rng or random.Random(0)
        self.in_flight = callbacks.in_flight
        self.data = _ContinuousData(self.dataloader, self.state["step"])
        self.total_steps = self.logger.total_steps
        self.time_budget = self.config.training.max_train_time_s
        self.final_dir = Path(self.config.output_dir) / "final_model"
        self.last_validation: tuple[int, dict[str, float]] | None = None
        self.early_stop = self.config.training.early_stop

    def is_complete(self) -> bool:
        """Whether the run already took all its steps (or ran out of its time budget, or stopped early)."""
        if self.time_budget is not None and self.state["train_time_s"] >= self.time_budget:
            self.total_steps = self.state["step"]  # a run that ended on its time budget is complete
        if self.early_stop is not None and self.state["early_stop"]["stopped"]:
            self.total_steps = self.state["step"]  # so is one that training.early_stop ended
        return self.state["step"] >= self.total_steps

    def note_baselines(self, metrics: dict[str, float]) -> None:
        """Keeps the teacher's value of the watched metric for ``target: teacher``; ConfigError if it is missing."""
        rule = self.early_stop
        if rule is None or not rule.targets_teacher:
            return
        key = TEACHER_PREFIX + rule.metric.removeprefix("val/")
        value = metrics.get(key)
        if value is None or not math.isfinite(value):
            self.logger.close()
            raise ConfigError(
                f"training.early_stop.target = teacher: the teacher baseline reported no finite {key} "
                f"(got {value}); give a number as the target"
            )
        self.state["early_stop"]["teacher_value"] = value
        log.info("training.early_stop: the target is the teacher's %s = %.4g", key, value)

    def check_teacher_target(self) -> None:
        """On resume: warns when ``target: teacher`` has no teacher value in the checkpoint."""
        rule = self.early_stop
        if rule is not None and rule.targets_teacher and self.state["early_stop"]["teacher_value"] is None:
            log.warning(
                "training.early_stop.target = teacher: checkpoint step_%d holds no teacher value (the run started "
                "without it); only the patience applies",
                self.state["step"],
            )

    def check_early_stop(self, metrics: dict[str, float] | None, step: int) -> bool:
        """Counts a validation for ``training.early_stop``; returns whether the run stops at ``step``.

        Step 0 only sets the first best. Raises ConfigError when the watched metric was not reported.
        """
        rule = self.early_stop
        if rule is None or metrics is None:
            return False
        value = metrics.get(rule.metric)
        if value is None:
            self.logger.close()
            reported = ", ".join(sorted(key for key in metrics if key.startswith("val/")))
            hint = _WHY_UNREPORTED.get(rule.metric, "")
            raise ConfigError(
                f"training.early_stop.metric = {rule.metric}: validation at step {step} did not report it "
                f"(it reported {reported}){hint}"
            )
        reason = observe(rule, self.state["early_stop"], value, step, judge=step > 0)
        if reason is None:
            return False
        log.info("training.early_stop: %s; stopping after step %d of %d", reason, step, self.total_steps)
        best = self.state["early_stop"]["best"]
        record: dict[str, Any] = {"early_stop/stopped": 1, "early_stop/value": value, "early_stop/reason": reason}
        if best is not None:
            record["early_stop/best"] = best
        self.logger.log_metrics(record, step, console_keys=[])
        self.total_steps = step
        return True

    def finish_complete_run(self) -> None:
        """A rerun of a finished run: writes the final model if a kill came between it and the last checkpoint."""
        if not (self.final_dir / "config.json").is_file():
            if self.logger.metrics_path.is_file():
                self.last_validation = last_validation(read_metrics(self.logger.metrics_path))
            write_final_model(self.policy, self.tokenizer, self.final_dir, self._model_card())
            log.info("the run was complete; final model written to %s from the last checkpoint", self.final_dir)
        else:
            log.info("the run is already complete (step %d of %d); nothing to do", self.state["step"], self.total_steps)
        self.logger.close()

    def restore_position(self) -> None:
        """Restores the RNG streams, the work in flight and, mid-epoch, the data position of the resumed checkpoint."""
        step = self.state["step"]
        checkpoint = self.checkpointer.root / f"step_{step}"
        with reading_checkpoint(checkpoint):
            training_state = self.checkpointer.load_training_state(checkpoint)
            teacher_state = self.checkpointer.load_teacher_state(checkpoint)
        teacher = self.callbacks.teacher_state
        if teacher is not None:  # before anything in flight is scored again
            teacher.load_state_dict(teacher_state)
        restore_rng_state(training_state["rng"], self.algorithm_rng)
        # Batches drawn ahead of the step (in flight) moved the data past it.
        position = training_state.get("data_position", step)
        if self.in_flight is not None:
            self.in_flight.load_state_dict(training_state.get("in_flight"))
        elif position != step:
            raise ConfigError(
                f"checkpoint step_{step} holds {position - step} batches in flight from an asynchronous "
                "training.scheduler; resume it with that scheduler"
            )
        self.data = _ContinuousData(self.dataloader, position)
        if position % len(self.dataloader):  # mid-epoch: continue after the last drawn batch
            self.dataloader.load_state_dict(training_state["dataloader"])

    def after_step(self, batch_size: int, metrics: dict[str, Any]) -> bool:
        """Counts, logs, guards, validates and checkpoints after a step; returns whether it was the last.

        Raises:
            TrainingDivergedError: after too many consecutive non-finite steps.
        """
        state, training = self.state, self.config.training
        state["step"] += 1
        state["consumed_samples"] += batch_size
        skipped = bool(metrics.get("train/skipped_nonfinite"))
        state["consecutive_nonfinite_steps"] = state["consecutive_nonfinite_steps"] + 1 if skipped else 0
        metrics["train/epoch"] = state["epoch"]
        self.logger.log_metrics(metrics, state["step"], console_keys=list(self.callbacks.console_keys))
        if skipped:
            self._guard_nonfinite()
        step = state["step"]
        out_of_time = self.time_budget is not None and state["train_time_s"] >= self.time_budget
        if out_of_time and step < self.total_steps:
            log.info("training.max_train_time_s=%s reached after step %d; finishing the run", self.time_budget, step)
            self.total_steps = step
        is_last = step >= self.total_steps
        if training.val_freq and step % training.val_freq == 0 and not is_last:
            is_last = self.check_early_stop(self.validate(step), step)
        if self.config.checkpointing.enabled and training.save_freq and step % training.save_freq == 0 and not is_last:
            self.save(step)
        return is_last

    def _guard_nonfinite(self) -> None:
        state = self.state
        log.warning("step %d: non-finite loss or gradient; step skipped, weights unchanged", state["step"])
        if state["consecutive_nonfinite_steps"] >= self.config.training.max_consecutive_nonfinite_steps:
            self.logger.close()
            raise TrainingDivergedError(
                f"{state['consecutive_nonfinite_steps']} consecutive steps had a non-finite loss or "
                f"gradient (last: step {state['step']}); the weights are still those of step "
                f"{state['step'] - state['consecutive_nonfinite_steps']}. Lower training.learning_rate "
                "or check the data; raise training.max_consecutive_nonfinite_steps to tolerate more."
            )

    def validate(self, step: int) -> dict[str, float] | None:
        """Runs validation (if any), tracks the best metric and logs; returns the metrics (None: no validation)."""
        start = time.perf_counter()
        metrics = self.callbacks.validate()
        if metrics is None:
            return None
        metrics["timing/validation"] = time.perf_counter() - start
        self._track_best(metrics, step)
        self.last_validation = (step, {key: value for key, value in metrics.items() if key.startswith("val/")})
        self.logger.log_metrics(metrics, step, console_keys=[key for key in metrics if key.startswith("val/")])
        return metrics

    def _model_card(self, harness_table: str | None = None) -> str:
        """``final_model/README.md`` for this run (see :mod:`opd.run.model_card`)."""
        config = self.config.model_dump(mode="json", by_alias=True)
        return render_model_card(config, self.state["step"], self.last_validation, harness_table)

    def _track_best(self, metrics: dict[str, float], step: int) -> None:
        checkpointing = self.config.checkpointing
        name = checkpointing.metric_name
        if name is None or name not in metrics or not math.isfinite(metrics[name]):
            return
        best = self.state["best_metric"]
        better = best is None or (metrics[name] > best if checkpointing.higher_is_better else metrics[name] < best)
        if better:
            self.state["best_metric"], self.state["best_step"] = metrics[name], step
            self.checkpointer.protected_step = step

    def save(self, step: int) -> None:
        """Writes the ``step_N`` checkpoint (weights, optimizer, counters, data position, RNGs, a teacher's state)."""
        start = time.perf_counter()
        teacher = self.callbacks.teacher_state
        path = self.checkpointer.save(
            step,
            self.policy,
            self.tokenizer,
            dict(self.state),
            {
                # In flight first: finishing it may not draw data, but it must be complete before the RNGs are read.
                "in_flight": self.in_flight.state_dict() if self.in_flight is not None else None,
                "data_position": self.data.position,
                "dataloader": self.dataloader.state_dict(),
                "rng": capture_rng_state(self.algorithm_rng),
            },
            config_to_yaml(self.config),
            teacher.state_dict() if teacher is not None else None,
        )
        seconds = time.perf_counter() - start
        self.logger.log_metrics({"timing/checkpoint": seconds}, step, console_keys=[])
        log.info("checkpoint %s written in %.2fs", path, seconds)

    def stop_on_signal(self, signal_name: str | None) -> None:
        """SIGINT / SIGTERM: checkpoint the step just finished (unless already saved) and say how to resume."""
        step = self.state["step"]
        checkpointing = self.config.checkpointing
        saved = checkpointing.enabled and checkpointing.save_on_signal
        if saved and self.checkpointer.latest_checkpoint() != self.checkpointer.root / f"step_{step}":
            self.save(step)
        self.logger.close()
        where = f"checkpoint {self.checkpointer.root / f'step_{step}'}" if saved else "no checkpoint written"
        print(
            f"opd: stopped by {signal_name} after step {step}/{self.total_steps} ({where}); "
            "rerun the same command to resume.",
            flush=True,
        )

    def finish(self) -> None:
        """The end of the run: final validation, last checkpoint, ``final_model/``."""
        step = self.state["step"]
        # A run that training.early_stop ended has just validated these very weights.
        validated = self.last_validation is not None and self.last_validation[0] == step
        if self.config.validation.val_at_end and not validated:
            self.validate(step)
        if self.config.checkpointing.enabled:
            self.save(self.state["step"])
        write_final_model(self.policy, self.tokenizer, self.final_dir, self._model_card())
        log.info("final model written to %s", self.final_dir)
        if self.config.validation.harness_tasks:
            self._evaluate_with_harness(step)
        self.logger.close()

    def _evaluate_with_harness(self, step: int) -> None:
        """Runs ``validation.harness_tasks``; scores go to the metrics log, files beside it, and the model card."""
        results = evaluate_run_models(self.config, str(self.final_dir))
        self.logger.log_metrics(results.metrics(), step, console_keys=list(results.metrics()))
        table = results.write(Path(self.logger.log_dir), self.config.validation.harness)
        (self.final_dir / CARD_FILENAME).write_text(self._model_card(results.table()), encoding="utf-8")
        log.info("harness results written to %s and the model card", table)


class _ContinuousData:
    """The training batches across epochs, counting them from ``position`` (where the caller put ``dataloader``)."""

    def __init__(self, dataloader: StatefulDataLoader, position: int) -> None:
        self.dataloader = dataloader
        self.position = position
        self._iterator: Any = None

    def next(self) -> list[Any]:
        """The next batch; a new epoch starts when the current one is used up."""
        for _ in range(2):  # at most once past an epoch's end
            if self._iterator is None:
                _set_epoch(self.dataloader, self.position // len(self.dataloader))
                self._iterator = iter(self.dataloader)
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._iterator = None
                continue
            self.position += 1
            return batch
        raise RuntimeError("the training data yielded no batch for a whole epoch")


def _set_epoch(dataloader: StatefulDataLoader, epoch: int) -> None:
    """Makes the shuffle order of this epoch a function of (seed, epoch) only."""
    sampler = dataloader.sampler
    if not isinstance(sampler, DistributedSampler):
        raise TypeError(f"the training loader needs a DistributedSampler (set_epoch), not {type(sampler).__name__}")
    sampler.set_epoch(epoch)


def evaluate_run_models(config: RunConfig, model_path: str) -> HarnessResults:
    """``validation.harness_tasks`` on ``model_path`` (``model``) and on the models ``validation.harness.compare``."""
    settings, loading = config.validation.harness, config.model_loading()
    comparisons = config.harness_comparisons()
    paths: dict[str, str] = {"model": model_path, **{name: comparisons[name] for name in settings.compare}}
    tasks = config.validation.harness_tasks
    return evaluate_with_harness(paths, tasks, settings, lambda path: load_for_harness(path, loading))


def find_resume_checkpoint(checkpointing_enabled: bool, checkpointer: CheckpointManager) -> Path | None:
    """The newest complete, verified ``step_N``, or None; half-written ``.tmp_step_N`` are removed first.

    Raises:
        CheckpointDamagedError: the newest checkpoint is damaged (see :meth:`CheckpointManager.verify`).
    """
    if not checkpointing_enabled:
        return None
    for leftover in checkpointer.remove_incomplete():
        log.warning("removed %s, an incomplete checkpoint from an interrupted write", leftover)
    latest = checkpointer.latest_checkpoint()
    if latest is not None:
        checkpointer.verify(latest)
    return latest


def check_output_is_fresh(output_dir: str, checkpointer: CheckpointManager) -> None:
    """Raises ConfigError rather than overwrite the final model of an earlier run that left no checkpoint to resume."""
    if (Path(output_dir) / "final_model").exists() and checkpointer.latest_checkpoint() is None:
        raise ConfigError(
            f"output_dir '{output_dir}' already holds final_model/ from an earlier run that left no "
            "checkpoint to resume from; choose another output_dir or move it away. Nothing was changed."
        )


def warn_on_config_change(checkpoint: Path, config: BaseModel) -> None:
    """Logs the keys whose values differ from the checkpoint's config, so a resume never changes a run silently."""
    saved_file = checkpoint / "config.yaml"
    if not saved_file.is_file():
        return
    saved = flatten_dict(yaml.safe_load(saved_file.read_text(encoding="utf-8")) or {})
    current = flatten_dict(config.model_dump(mode="json", by_alias=True))
    changed = sorted(key for key in saved.keys() | current.keys() if saved.get(key) != current.get(key))
    if changed:
        log.warning(
            "resuming with a config that differs from %s in: %s",
            saved_file,
            ", ".join(f"{key} ({saved.get(key)!r} -> {current.get(key)!r})" for key in changed),
        )


def write_final_model(policy: PolicyInterface, tokenizer: Any, final_dir: Path, model_card: str | None = None) -> None:
    """Writes the model (and ``model_card`` as README.md) as an HF directory atomically: never a partial one."""
    staging = staging_directory(final_dir)
    policy.save_pretrained(str(staging), tokenizer=tokenizer)
    if model_card is not None:
        (staging / CARD_FILENAME).write_text(model_card, encoding="utf-8")
    publish_directory(staging, final_dir)
