"""The run lifecycle shared by every algorithm: steps, validation, checkpoints, resume, stop.

``distillation_train`` and ``sft_train`` differ only in what one step does. Everything
around the step lives here, once:

* resume: restore RNG streams (including an algorithm's own coin) and the data position
  from the checkpoint ``setup()`` resumed from, and drop log records of steps to redo;
* epochs: ``sampler.set_epoch(e)`` so each epoch's order depends on (seed, epoch) only;
* per step: counters, the non-finite guard, logging;
* every ``val_freq`` / ``save_freq`` steps: validation (with best-metric tracking) and
  atomic checkpoints;
* SIGINT / SIGTERM: finish the step, checkpoint, exit cleanly;
* at the end: final validation, last checkpoint, ``final_model/`` written atomically.

The config object only needs the sections both algorithms share: ``output_dir``,
``training`` (``val_freq``, ``save_freq``, ``max_consecutive_nonfinite_steps``),
``validation`` (``val_at_start``, ``val_at_end``) and ``checkpointing``.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, TypedDict

import yaml
from pydantic import BaseModel, Field
from torchdata.stateful_dataloader import StatefulDataLoader

from opd.models.policy.hf_policy import OptimizerConfig
from opd.utils.checkpoint import CheckpointManager
from opd.utils.config import config_to_yaml
from opd.utils.errors import ConfigError, TrainingDivergedError
from opd.utils.logger import Logger
from opd.utils.rng import capture_rng_state, restore_rng_state
from opd.utils.signals import GracefulStop

log = logging.getLogger("opd")

class TrainingLoopConfig(OptimizerConfig):
    """Run-length, cadence and safety settings that every algorithm's ``training`` section shares."""

    num_epochs: int = Field(1, ge=1, description="passes over the training data")
    max_num_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    max_train_time_s: float | None = Field(
        None, gt=0,
        description="end the run once its optimizer steps (not validation or checkpoints) have taken this "
        "many seconds; for equal-compute comparisons. The learning-rate schedule still follows max_num_steps",
    )
    val_freq: int = Field(0, ge=0, description="validate every N steps; 0 disables periodic validation")
    save_freq: int = Field(0, ge=0, description="checkpoint every N steps; 0 saves only at the end")
    max_consecutive_nonfinite_steps: int = Field(
        5, ge=1, description="stop after this many steps in a row with a NaN/inf loss or gradient"
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
    """Seconds spent in optimizer steps so far (validation and checkpoints excluded)."""


def fresh_save_state() -> RunSaveState:
    """The save state of a run that has not taken a step yet."""
    return {"step": 0, "epoch": 0, "consumed_samples": 0, "best_metric": None, "best_step": None,
            "consecutive_nonfinite_steps": 0, "train_time_s": 0.0}


StepFn = Callable[[list[Any]], dict[str, Any]]
"""Runs one optimizer step on a batch of examples; returns namespaced metrics
(``train/*``, ``timing/*``, ...) including ``train/skipped_nonfinite``."""

ValidateFn = Callable[[], dict[str, float]]
"""Runs validation; returns ``val/*`` metrics."""


def run_training_loop(
    *,
    policy: Any,
    tokenizer: Any,
    dataloader: StatefulDataLoader,
    logger: Logger,
    checkpointer: CheckpointManager,
    state: dict[str, Any],
    config: BaseModel,
    train_step: StepFn,
    validate: ValidateFn | None,
    before_first_step: Callable[[], None] | None = None,
    algorithm_rng: random.Random | None = None,
    console_keys: list[str] | None = None,
) -> None:
    """Drives a run from ``state["step"]`` to ``logger.total_steps``.

    Args:
        policy: the trained model; needs ``save_pretrained(dir, tokenizer=...)`` and
            ``state_dict()`` (see :class:`~opd.utils.checkpoint.CheckpointManager`).
        tokenizer: saved with every checkpoint and the final model.
        dataloader: the resumable training loader (one batch per step).
        logger: metric sink; its ``total_steps`` is the run length.
        checkpointer: writes and finds ``step_N`` checkpoints.
        state: the save state (``step``, ``epoch``, ``consumed_samples``, ``best_metric``,
            ``best_step``, ``consecutive_nonfinite_steps``); updated in place.
        config: the run's validated config (saved as ``config.yaml`` in checkpoints).
        train_step: one optimizer step on a batch.
        validate: validation, or None when there is no validation data.
        before_first_step: runs once on a fresh (not resumed) run, before the start
            validation (e.g. a teacher baseline).
        algorithm_rng: an algorithm's own generator (the λ coin), checkpointed with the rest.
        console_keys: step metrics shown on the console.

    Raises:
        TrainingDivergedError: after ``max_consecutive_nonfinite_steps`` skipped steps.
    """
    algorithm_rng = algorithm_rng or random.Random(0)
    training, checkpointing = config.training, config.checkpointing  # type: ignore[attr-defined]
    total_steps = logger.total_steps
    time_budget = training.max_train_time_s
    state.setdefault("train_time_s", 0.0)  # checkpoints written before this counter existed
    steps_per_epoch = len(dataloader)
    final_dir = Path(config.output_dir) / "final_model"  # type: ignore[attr-defined]

    def run_validation(step: int) -> None:
        if validate is None:
            return
        start = time.perf_counter()
        metrics = validate()
        metrics["timing/validation"] = time.perf_counter() - start
        _track_best(metrics, step)
        logger.log_metrics(metrics, step, console_keys=[key for key in metrics if key.startswith("val/")])

    def _track_best(metrics: dict[str, float], step: int) -> None:
        name = checkpointing.metric_name
        if name is None or name not in metrics or not math.isfinite(metrics[name]):
            return
        best = state["best_metric"]
        better = best is None or (metrics[name] > best if checkpointing.higher_is_better else metrics[name] < best)
        if better:
            state["best_metric"], state["best_step"] = metrics[name], step
            checkpointer.protected_step = step

    def save(step: int) -> None:
        start = time.perf_counter()
        path = checkpointer.save(
            step, policy, tokenizer, dict(state),
            {"dataloader": dataloader.state_dict(), "rng": capture_rng_state(algorithm_rng)},
            config_to_yaml(config),
        )
        seconds = time.perf_counter() - start
        logger.log_metrics({"timing/checkpoint": seconds}, step, console_keys=[])
        log.info("checkpoint %s written in %.2fs", path, seconds)

    if time_budget is not None and state["train_time_s"] >= time_budget:
        total_steps = state["step"]  # a run that ended on its time budget is complete
    if state["step"] >= total_steps:
        if not (final_dir / "config.json").is_file():
            # Killed after the last checkpoint but before the final model was written.
            write_final_model(policy, tokenizer, final_dir)
            log.info("the run was complete; final model written to %s from the last checkpoint", final_dir)
        else:
            log.info("the run is already complete (step %d of %d); nothing to do", state["step"], total_steps)
        logger.close()
        return
    # Records past the resumed step belong to steps that are about to be re-run.
    logger.truncate_after(state["step"])
    if state["step"] > 0:
        training_state = checkpointer.load_training_state(checkpointer.root / f"step_{state['step']}")
        restore_rng_state(training_state["rng"], algorithm_rng)
        if state["step"] % steps_per_epoch:  # mid-epoch: continue after the last consumed batch
            dataloader.load_state_dict(training_state["dataloader"])
    else:
        if before_first_step is not None:
            before_first_step()
        if config.validation.val_at_start:  # type: ignore[attr-defined]
            run_validation(0)

    with GracefulStop() as stop:
        while state["step"] < total_steps and not stop.requested:
            state["epoch"] = state["step"] // steps_per_epoch
            dataloader.sampler.set_epoch(state["epoch"])  # type: ignore[attr-defined]
            for examples in dataloader:
                step_start = time.perf_counter()
                metrics = train_step(examples)
                state["train_time_s"] += time.perf_counter() - step_start
                state["step"] += 1
                state["consumed_samples"] += len(examples)
                skipped = bool(metrics.get("train/skipped_nonfinite"))
                state["consecutive_nonfinite_steps"] = state["consecutive_nonfinite_steps"] + 1 if skipped else 0
                metrics["train/epoch"] = state["epoch"]
                logger.log_metrics(metrics, state["step"], console_keys=console_keys)
                if skipped:
                    log.warning("step %d: non-finite loss or gradient; step skipped, weights unchanged", state["step"])
                    if state["consecutive_nonfinite_steps"] >= training.max_consecutive_nonfinite_steps:
                        logger.close()
                        raise TrainingDivergedError(
                            f"{state['consecutive_nonfinite_steps']} consecutive steps had a non-finite loss or "
                            f"gradient (last: step {state['step']}); the weights are still those of step "
                            f"{state['step'] - state['consecutive_nonfinite_steps']}. Lower training.learning_rate "
                            "or check the data; raise training.max_consecutive_nonfinite_steps to tolerate more."
                        )
                step = state["step"]
                out_of_time = time_budget is not None and state["train_time_s"] >= time_budget
                if out_of_time and step < total_steps:
                    log.info("training.max_train_time_s=%s reached after step %d; finishing the run", time_budget, step)
                    total_steps = step
                is_last = step >= total_steps
                if training.val_freq and step % training.val_freq == 0 and not is_last:
                    run_validation(step)
                if checkpointing.enabled and training.save_freq and step % training.save_freq == 0 and not is_last:
                    save(step)
                if is_last or stop.requested:
                    break

        if stop.requested and state["step"] < total_steps:
            step = state["step"]
            saved = checkpointing.enabled and checkpointing.save_on_signal
            if saved and checkpointer.latest_checkpoint() != checkpointer.root / f"step_{step}":
                save(step)
            logger.close()
            where = f"checkpoint {checkpointer.root / f'step_{step}'}" if saved else "no checkpoint written"
            print(f"opd: stopped by {stop.signal_name} after step {step}/{total_steps} ({where}); "
                  "rerun the same command to resume.", flush=True)
            return

    if config.validation.val_at_end:  # type: ignore[attr-defined]
        run_validation(state["step"])
    if checkpointing.enabled:
        save(state["step"])
    write_final_model(policy, tokenizer, final_dir)
    log.info("final model written to %s", final_dir)
    logger.close()


def find_resume_checkpoint(checkpointing_enabled: bool, checkpointer: CheckpointManager) -> Path | None:
    """The checkpoint a run resumes from: the newest complete ``step_N``, or None.

    Half-written ``.tmp_step_N`` directories left by a killed write are removed first
    (with a warning), so they can never be mistaken for a checkpoint.
    """
    if not checkpointing_enabled:
        return None
    for leftover in checkpointer.remove_incomplete():
        log.warning("removed %s, an incomplete checkpoint from an interrupted write", leftover)
    return checkpointer.latest_checkpoint()


def check_output_is_fresh(output_dir: str, checkpointer: CheckpointManager) -> None:
    """Refuses to overwrite the final model of an earlier run that left no checkpoint.

    With checkpoints, rerunning the same command resumes instead.

    Raises:
        ConfigError: naming the directory that already holds a final model.
    """
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
    saved = _flatten(yaml.safe_load(saved_file.read_text(encoding="utf-8")) or {})
    current = _flatten(config.model_dump(mode="json", by_alias=True))
    changed = sorted(key for key in saved.keys() | current.keys() if saved.get(key) != current.get(key))
    if changed:
        log.warning(
            "resuming with a config that differs from %s in: %s",
            saved_file,
            ", ".join(f"{key} ({saved.get(key)!r} -> {current.get(key)!r})" for key in changed),
        )


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def write_final_model(policy: Any, tokenizer: Any, final_dir: Path) -> None:
    """Writes the model as an HF model directory, atomically (temporary dir, then rename).

    A kill mid-write leaves the previous ``final_model/`` (or none), never a partial one.
    """
    staging = final_dir.with_name(f".tmp_{final_dir.name}")
    if staging.exists():
        shutil.rmtree(staging)
    policy.save_pretrained(str(staging), tokenizer=tokenizer)
    if final_dir.exists():
        retired = final_dir.with_name(f".old_{final_dir.name}")
        if retired.exists():
            shutil.rmtree(retired)
        os.replace(final_dir, retired)
        os.replace(staging, final_dir)
        shutil.rmtree(retired)
    else:
        os.replace(staging, final_dir)
