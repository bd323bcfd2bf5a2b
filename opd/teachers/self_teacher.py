"""Self-distillation teachers that follow the student: ``teacher.self_teacher`` = ``live`` or ``ema``.

With ``model.teacher_model_path: student`` the teacher is the student's own model, usually reading a teacher-only
context (``distillation.teacher_context_key``; :class:`~opd.teachers.context_teacher.ContextTeacher`).
``teacher.self_teacher`` picks its weights:

* ``frozen`` (the default): a copy of the initial weights, an ordinary
  :class:`~opd.teachers.local_teacher.LocalTeacher` (not built here);
* ``live`` (:class:`LiveTeacher`): the student's current weights, the very module it trains (a LoRA student's
  adapters included). Without a teacher-only context it answers exactly what the student does;
* ``ema`` (:class:`EmaTeacher`): a copy following θ_T ← d·θ_T + (1 − d)·θ_S (d = ``teacher.ema_decay``), θ_S as a
  refit sends them (:meth:`PolicyInterface.weights_for_refit`: LoRA merged). The driver calls
  :meth:`TeacherInterface.follow_student` after each optimizer step, before anything scores the next batch. The
  average is checkpointed (:meth:`EmaTeacher.state_dict`); a checkpoint without it is refused on resume rather than
  restarted from the student. A bf16 / fp16 model keeps its average in float32: (1 − d)·(θ_S − θ_T) is below their
  resolution at d near 1.

:data:`FOLLOWING_TEACHERS` builds each; :func:`self_teacher_problem` says which settings they cannot run with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.models.interfaces import PolicyInterface, TeacherRequest, TeacherSignal
from opd.teachers.local_teacher import LocalTeacher
from opd.teachers.shared_prompt import sharing_problem
from opd.utils.errors import OpdError
from opd.utils.refusals import Refusal, first_problem
from opd.utils.timer import Timer

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

    from opd.teachers.backends import TeacherLoader

SELF_DISTILLATION_TEACHER = "student"
"""``model.teacher_model_path: student``: the teacher is the student's own model (weights: ``teacher.self_teacher``)."""

SelfTeacherName = Literal["frozen", "live", "ema"]
"""The values of ``teacher.self_teacher``."""

_LOW_PRECISION = (torch.bfloat16, torch.float16)


class LiveTeacher(LocalTeacher):
    """The student as its own teacher, scoring with the very module the student trains.

    Scores under ``torch.no_grad`` (not inference mode: the tensors take part in the student's backward pass), in eval
    mode for the scoring only; unlike :class:`LocalTeacher` it neither freezes the model nor leaves it in eval mode.
    ``model`` may be taken before or after LoRA wrapping: peft injects the adapters into this same module.
    """

    def __init__(self, model: PreTrainedModel, share_prompt_forward: bool = True) -> None:
        # Not LocalTeacher.__init__: it freezes its model, and this model is the student.
        self.no_grad_mode = torch.no_grad
        self.model = model
        self.share_prompt_forward = share_prompt_forward and sharing_problem(model) is None

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """The student's answer with its current weights, in eval mode (no dropout); its modes are put back."""
        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        try:
            return super().score(data, request)
        finally:
            for module, training in modes:
                module.training = training


class EmaTeacher(LocalTeacher):
    """A frozen copy of the student, loaded with its initial weights, that follows it by an EMA (0 < ``decay`` < 1)."""

    def __init__(self, model: PreTrainedModel, decay: float, share_prompt_forward: bool = True) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        super().__init__(model, share_prompt_forward)
        self.decay = decay
        self.version = 0
        """Optimizer steps of the student averaged in so far."""
        self.weights = {name: param.detach() for name, param in model.named_parameters()}
        self.kept_apart = {name for name, weight in self.weights.items() if weight.dtype in _LOW_PRECISION}
        """Weights whose average is a float32 copy, written into the model after each update."""
        # The average itself: the model's own weights, or float32 copies of low-precision ones.
        self.average = {
            name: weight.float().clone() if name in self.kept_apart else weight for name, weight in self.weights.items()
        }

    def follow_student(self, student: PolicyInterface, version: int, timer: Timer | None = None) -> None:
        """Averages in the student's weights after optimizer step ``version``, once per step.

        Raises OpdError for a skipped step or a student whose weight names are not this copy's.
        """
        if version <= self.version:  # this step is in the average already
            return
        if version != self.version + 1:
            raise OpdError(
                f"the EMA teacher holds the average of {self.version} student steps and was asked to add step "
                f"{version}; every step must be averaged in, in order"
            )
        timing = timer.time("teacher_update") if timer is not None else contextlib.nullcontext()
        keep = 1.0 - self.decay
        seen = set()
        with timing, torch.no_grad():
            for name, weight in student.weights_for_refit():
                average = self.average.get(name)
                if average is None:
                    raise OpdError(f"the student has a weight {name} that its EMA teacher (a copy of it) does not")
                average.mul_(self.decay).add_(weight.to(device=average.device, dtype=average.dtype), alpha=keep)
                seen.add(name)
            missing = sorted(set(self.average) - seen)
            if missing:
                raise OpdError(f"the student sent no weight for {missing[:3]}, which its EMA teacher holds")
            self._copy_average_into_model()
        self.version = version

    def _copy_average_into_model(self) -> None:
        for name in self.kept_apart:
            self.weights[name].copy_(self.average[name])

    def state_dict(self) -> dict[str, Any]:
        """The average (float32 where the model is in lower precision) and the steps in it."""
        return {"ema_version": self.version, "ema_weights": dict(self.average)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restores a checkpoint's average; OpdError if it has none (another ``self_teacher``) or other weights."""
        if state is None or "ema_weights" not in state:
            raise OpdError(
                "teacher.self_teacher = ema: the checkpoint holds no EMA teacher (it was written with another "
                "teacher.self_teacher); resume with that setting, or start the run in a new output_dir (the "
                "average is never restarted from the student)"
            )
        weights = state["ema_weights"]
        if set(weights) != set(self.average):
            raise OpdError(
                "the checkpoint's EMA teacher has other weights than this run's student "
                f"(e.g. {sorted(set(weights) ^ set(self.average))[:3]}); resume with the run's own model"
            )
        with torch.no_grad():
            for name, average in self.average.items():
                average.copy_(weights[name])
            self._copy_average_into_model()
        self.version = int(state["ema_version"])


FollowingTeacherBuilder = Callable[["TeacherLoader", "PreTrainedModel", float, bool], LocalTeacher]
"""``(loader, student's module, ema_decay, share_prompt_forward) -> teacher``."""


def _live(loader: TeacherLoader, student: PreTrainedModel, decay: float, share_prompt_forward: bool) -> LocalTeacher:
    return LiveTeacher(student, share_prompt_forward)


def _ema(loader: TeacherLoader, student: PreTrainedModel, decay: float, share_prompt_forward: bool) -> LocalTeacher:
    # The student's starting point, loaded like a frozen self-teacher; a resumed run restores its average into it.
    return EmaTeacher(loader.load(SELF_DISTILLATION_TEACHER), decay, share_prompt_forward)


@dataclass(frozen=True)
class FollowingTeacher:
    """A ``teacher.self_teacher`` following the student; ``is_the_student``: it scores with the student's weights."""

    build: FollowingTeacherBuilder
    is_the_student: bool


FOLLOWING_TEACHERS: dict[str, FollowingTeacher] = {
    "live": FollowingTeacher(_live, is_the_student=True),
    "ema": FollowingTeacher(_ema, is_the_student=False),
}
"""The values of ``teacher.self_teacher`` whose teacher follows the student (``frozen`` is built by its backend)."""


@dataclass(frozen=True)
class SelfTeacherSetting:
    """``teacher.self_teacher`` and the settings it must agree with.

    ``served``: ``teacher.backend`` = remote; ``several``: ``teachers:`` set; ``on_cluster``: ``cluster:`` set;
    ``scores_ahead``: ``training.scheduler`` scores a batch while the student trains on another; ``has_context``:
    ``distillation.teacher_context`` or ``teacher_context_key`` set.
    """

    value: str
    model_path: str | None
    served: bool
    several: bool
    cross_tokenizer: bool
    on_cluster: bool
    scores_ahead: bool
    has_context: bool


_FOLLOWING_TEACHER_REFUSALS: tuple[Refusal[SelfTeacherSetting], ...] = (
    Refusal(
        lambda setting: setting.several,
        " is for the one teacher of model.teacher_model_path; several teachers (teachers:) are frozen "
        "(a member's model_path: student is the student's initial weights); remove one or the other",
    ),
    Refusal(
        lambda setting: setting.served,
        " follows the student's weights in this process, which a served teacher (teacher.backend = remote) cannot",
    ),
    Refusal(
        lambda setting: setting.model_path != SELF_DISTILLATION_TEACHER,
        lambda setting: (
            f" makes the student its own teacher: set model.teacher_model_path = "
            f"{SELF_DISTILLATION_TEACHER} (it is {setting.model_path!r}; another model's teacher is frozen)"
        ),
    ),
    Refusal(
        lambda setting: setting.cross_tokenizer,
        ": the student shares its own tokenizer; set teacher.cross_tokenizer = false",
    ),
    Refusal(
        lambda setting: setting.on_cluster,
        " is not supported on a cluster yet: there the student is sharded across the trainer workers and the "
        "teacher loads a copy of its own, which does not follow the student; use teacher.self_teacher = frozen, "
        "or train in one process (no cluster: section)",
    ),
    Refusal(
        lambda setting: FOLLOWING_TEACHERS[setting.value].is_the_student and not setting.has_context,
        " without a teacher-only context is the student scoring its own tokens under its own prompt: every "
        "divergence is 0 and there is nothing to learn; set distillation.teacher_context or teacher_context_key "
        "(or use teacher.self_teacher = ema)",
    ),
    Refusal(
        lambda setting: setting.scores_ahead,
        " with training.scheduler = two_step_off: the teacher would score each batch during the update before "
        "the one that trains on it (one update behind the student it teaches), and a resumed run would score it "
        "again with later weights; use training.scheduler = sync or one_step_off",
    ),
)
"""What a teacher that follows the student cannot run with, each said after ``teacher.self_teacher = <value>``."""


def self_teacher_problem(setting: SelfTeacherSetting) -> str | None:
    """Why ``teacher.self_teacher`` cannot run with these settings, or None."""
    if setting.value not in FOLLOWING_TEACHERS:
        return None
    problem = first_problem(_FOLLOWING_TEACHER_REFUSALS, setting)
    return None if problem is None else f"teacher.self_teacher = {setting.value}{problem}"
