"""λ as a schedule: the probability of an on-policy step, as a function of the step.

A student far from the teacher learns faster from fixed data (λ = 0) and, once close, from its own samples (λ = 1):
a ramp does both. The schedule is a pure function of the step, so a resumed run gets the same λ per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field

from opd.utils.config import StrictConfig


class LambdaSchedule(StrictConfig):
    """``distillation.lambda`` as a schedule over the optimizer steps (1-based)."""

    schedule: Literal["linear", "step"] = Field(
        description="linear = from start to end over `steps` steps; step = start, then end from step `steps` on"
    )
    start: float = Field(ge=0.0, le=1.0, description="λ at step 1")
    end: float = Field(ge=0.0, le=1.0, description="λ at the schedule's end (linear) or from its switch on (step)")
    steps: int = Field(ge=1, description="linear: the step where λ reaches end; step: the first step with end")

    def at(self, step: int) -> float:
        """λ of optimizer step ``step`` (1-based)."""
        return _SHAPES[self.schedule](self, step)

    def lowest(self) -> float:
        """The smallest λ of any step (what decides whether fixed data is ever needed)."""
        return min(self.start, self.end)


def _linear(schedule: LambdaSchedule, step: int) -> float:
    if schedule.steps == 1 or step >= schedule.steps:
        return schedule.end
    fraction = (max(step, 1) - 1) / (schedule.steps - 1)
    return schedule.start + (schedule.end - schedule.start) * fraction


def _step(schedule: LambdaSchedule, step: int) -> float:
    return schedule.end if step >= schedule.steps else schedule.start


_SHAPES: dict[str, Callable[[LambdaSchedule, int], float]] = {"linear": _linear, "step": _step}
"""λ of a step under each ``schedule``."""
