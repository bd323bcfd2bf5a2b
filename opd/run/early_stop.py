"""Early stopping (``training.early_stop``): end a run when a validation metric stops improving or reaches a target.

The rule follows Hugging Face's ``EarlyStoppingCallback``, plus a target:

* a validation *improves* when its value beats the best so far by more than ``min_delta`` (in the direction of
  ``mode``); the first finite value is the first best;
* ``patience``: the run stops after that many validations in a row without improving;
* ``target``: the run stops at the first validation whose value reaches it, within ``target_tolerance`` (at
  least ``target − target_tolerance`` with ``mode: max``, at most ``target + target_tolerance`` with ``min``).
  ``target: teacher`` is the teacher's own value from the teacher baseline (``validation.teacher_baseline``),
  e.g. ``val/teacher_accuracy`` for ``val/accuracy``. A student may match its teacher on all but one validation
  example and never on that one, so a target of ``teacher`` usually wants a tolerance, such as one example's
  share of the accuracy (1/n for n validation examples);
* a NaN or infinite value never improves and never reaches the target;
* the validation before the first step (``validation.val_at_start``) sets the first best but neither counts
  against the patience nor stops the run: the rule judges training.

The rule acts at the periodic validations (``training.val_freq``). Its counters are checkpointed
(:class:`EarlyStopState`), so a resumed run stops where the uninterrupted run would have.
"""

from __future__ import annotations

import math
from typing import Any, Literal, TypedDict

from pydantic import Field, field_validator

from opd.utils.config import StrictConfig

BETTER: dict[str, Literal["max", "min"] | None] = {
    "val/accuracy": "max",
    "val/kl_forward": "min",
    "val/kl_reverse": "min",
    "val/truncation_rate": "min",
    "val/mean_response_length": None,
}
"""The metrics every validation reports, and which direction is better (None: neither; ``mode`` must say)."""

TEACHER_PREFIX = "val/teacher_"
"""The teacher baseline's metrics: ``val/teacher_<name>`` for validation's ``val/<name>``."""

TEACHER_BASELINE_METRICS = ("val/accuracy", "val/mean_response_length", "val/truncation_rate")
"""The metrics the teacher baseline measures for itself (it has no KL to itself)."""

SIGN_OF_BETTER: dict[Literal["max", "min"], float] = {"max": 1.0, "min": -1.0}
"""Which way each ``mode`` counts a change as a gain: +1 where higher is better, -1 where lower is."""


class EarlyStopConfig(StrictConfig):
    """``training.early_stop``: which validation metric ends the run, and when."""

    metric: str = Field(description="the validation metric watched, e.g. val/accuracy")
    mode: Literal["max", "min"] | None = Field(
        None, description="max: higher is better; min: lower is better; null = from the metric"
    )
    patience: int | None = Field(
        None,
        ge=1,
        description="stop after this many validations in a row without an improvement of more than min_delta; "
        "null = never for lack of improvement",
    )
    min_delta: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="the smallest change that improves")
    target: float | Literal["teacher"] | None = Field(
        None,
        description="stop as soon as the metric reaches this value; teacher = the teacher's own value from "
        "validation.teacher_baseline; null = no target",
    )
    target_tolerance: float = Field(
        0.0,
        ge=0.0,
        allow_inf_nan=False,
        description="the target counts as reached within this distance (e.g. 1/n for one of n validation "
        "examples' accuracy)",
    )

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, metric: str) -> str:
        if metric not in BETTER:
            raise ValueError(f"expected a metric that every validation reports: {', '.join(BETTER)}")
        return metric

    @field_validator("target", mode="before")
    @classmethod
    def _number_or_teacher(cls, target: Any) -> Any:
        if isinstance(target, str) and target != "teacher":
            raise ValueError("expected a number, teacher or null")
        if isinstance(target, (int, float)) and not isinstance(target, bool) and not math.isfinite(target):
            raise ValueError("expected a finite number")
        return target

    def resolved_mode(self) -> Literal["max", "min"] | None:
        """``mode``, or the metric's better direction when ``mode`` is null (None: the metric has none)."""
        return self.mode if self.mode is not None else BETTER[self.metric]

    @property
    def targets_teacher(self) -> bool:
        """Whether the target is the teacher's own value (``target: teacher``), measured by the teacher baseline."""
        return self.target == "teacher"

    def problem(self) -> str | None:
        """What makes the section unusable on its own (each message names the key), or None."""
        if self.resolved_mode() is None:
            return (
                f"training.early_stop.metric = {self.metric} is better neither higher nor lower; "
                "set training.early_stop.mode to max or min"
            )
        if self.patience is None and self.target is None:
            return "training.early_stop needs a patience, a target or both; set training.early_stop.patience or target"
        if self.targets_teacher and self.metric not in TEACHER_BASELINE_METRICS:
            return (
                f"training.early_stop.target = teacher: the teacher baseline has no {self.metric} of its own "
                f"(it measures {', '.join(TEACHER_BASELINE_METRICS)}); give a number"
            )
        return None


class EarlyStopState(TypedDict):
    """The rule's counters, saved in every checkpoint (``save_state.json``, ``early_stop``)."""

    best: float | None
    best_step: int | None
    bad_validations: int
    """Validations in a row since the last improvement."""
    teacher_value: float | None
    """The teacher baseline's value of the metric (``target: teacher``), measured once before the first step."""
    stopped: bool
    """Whether the rule ended the run (a rerun of the same command then has nothing to do)."""


def fresh_early_stop_state() -> EarlyStopState:
    """The counters of a run that has not validated yet."""
    return {"best": None, "best_step": None, "bad_validations": 0, "teacher_value": None, "stopped": False}


def observe(config: EarlyStopConfig, state: EarlyStopState, value: float, step: int, judge: bool = True) -> str | None:
    """Counts one validation (``judge`` False: the one before the first step); returns why the run stops, or None."""
    mode = config.resolved_mode()
    assert mode is not None, "an EarlyStopConfig without a direction is refused when the config is validated"
    finite = math.isfinite(value)
    best = state["best"]
    sign = SIGN_OF_BETTER[mode]
    gain = 0.0 if best is None or not finite else sign * (value - best)
    if finite and (best is None or gain > config.min_delta):
        state["best"], state["best_step"], state["bad_validations"] = value, step, 0
    elif judge:
        state["bad_validations"] += 1
    if not judge:
        return None
    # The value that stops the run (None: no target): the teacher baseline's for target: teacher.
    target = state["teacher_value"] if isinstance(config.target, str) else config.target
    if target is not None and finite and sign * (value - target) >= -config.target_tolerance:
        whose = " (the teacher's)" if config.targets_teacher else ""
        within = f" within {config.target_tolerance:.4g}" if config.target_tolerance else ""
        reason = f"{config.metric} = {value:.4g} reached the target {target:.4g}{whose}{within} at step {step}"
    elif config.patience is not None and state["bad_validations"] >= config.patience:
        reason = (
            f"{config.metric} = {value:.4g} at step {step}: {state['bad_validations']} validations without "
            f"improving on the best {_format_best(state)} by more than min_delta = {config.min_delta:g}"
        )
    else:
        return None
    state["stopped"] = True
    return reason


def _format_best(state: EarlyStopState) -> str:
    if state["best"] is None:
        return "value (none was finite yet)"
    return f"{state['best']:.4g} (step {state['best_step']})"
