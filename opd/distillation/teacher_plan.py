"""Which teacher answers, resolved once from the config: the teacher plan, and the one assembly of it.

``teacher`` / ``teachers``, ``cluster.teacher`` and ``loss_fn`` decide together; :func:`plan_teacher` reads them into
a :class:`TeacherPlan` (each member, where it runs, what it sends, the wrappers), which ``opd train`` logs and
``opd plan`` prints. Every placement (one process, a cluster's driver, each trainer worker) builds its teacher with
:func:`assemble_teacher`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from opd.distillation.config import MasterConfig
from opd.models.interfaces import FullVocabRequest, TeacherInterface, TopKRequest
from opd.teachers.backends import TeacherSourceConfig
from opd.teachers.context_teacher import ContextTeacher
from opd.teachers.cross_tokenizer import CrossTokenizerTeacher
from opd.teachers.self_teacher import SELF_DISTILLATION_TEACHER
from opd.teachers.several_teachers import RoutedTeachers, TeacherMixture

log = logging.getLogger("opd")


class Placement(Enum):
    """Where a teacher runs."""

    IN_PROCESS = "in process"
    TRAINER_WORKERS = "trainer workers"
    POOL = "pool"
    SERVED = "served"

    @property
    def beside_the_student(self) -> bool:
        """It runs where the student's hidden states are: full-vocabulary logits are made in place."""
        return self in (Placement.IN_PROCESS, Placement.TRAINER_WORKERS)


@dataclass(frozen=True)
class PlannedMember:
    """One teacher as the plan names it (``name`` None: the one teacher; ``detail``: a pool's engine and size)."""

    name: str | None
    source: str
    placement: Placement
    detail: str
    sends: str


@dataclass(frozen=True)
class TeacherPlan:
    """The run's teacher: its members in order, and the wrappers around them, outermost last."""

    members: tuple[PlannedMember, ...]
    wrappers: tuple[str, ...]

    def lines(self) -> list[str]:
        """The plan as lines of text (``opd train`` logs them, ``opd plan`` prints them)."""
        lines = ["teacher plan:"]
        for member in self.members:
            label = f"{member.name}: " if member.name is not None else ""
            where = member.placement.value + (f" ({member.detail})" if member.detail else "")
            lines.append(f"  {label}{member.source} | runs {where} | sends {member.sends}")
        if self.wrappers:
            lines.append(f"  wrapped in: {', '.join(self.wrappers)}")
        return lines


def _placement(config: MasterConfig, served: bool) -> tuple[Placement, str]:
    if served:
        return Placement.SERVED, ""
    if config.cluster is None:
        return Placement.IN_PROCESS, ""
    teacher = config.cluster.teacher
    if not teacher.in_pool:
        return Placement.TRAINER_WORKERS, ""
    shards = f", {teacher.shards_per_replica} shards per replica" if teacher.shards_per_replica > 1 else ""
    return Placement.POOL, f"{teacher.engine}, {teacher.workers} workers{shards}"


def _sends(request: Any, placement: Placement) -> str:
    if isinstance(request, FullVocabRequest):
        if placement.beside_the_student:
            return "full-vocabulary logits, made in place"
        return "final hidden states (the trainer applies its copy of the output layer)"
    if isinstance(request, TopKRequest):
        return f"top-{request.k} log-probs"
    return "log-probs of the sampled tokens"


def _source(config: MasterConfig, model_path: str | None, teacher: TeacherSourceConfig) -> str:
    if teacher.served:
        return str(teacher.remote.url)
    if model_path == SELF_DISTILLATION_TEACHER:
        return f"student ({config.teacher.self_teacher})"
    return str(model_path)


def plan_teacher(config: MasterConfig) -> TeacherPlan:
    """The run's teacher plan."""
    wrappers: list[str] = []
    if config.distillation.teacher_context_spec() is not None:
        wrappers.append("teacher-only context")
    teachers: list[tuple[str | None, str | None, TeacherSourceConfig]]  # name, model path, where it runs
    if config.teachers is None:
        teachers = [(None, config.model.teacher_model_path, config.teacher)]
        if config.teacher.cross_tokenizer:
            wrappers.append("cross-tokenizer (classes of tokens both vocabularies share)")
    else:
        teachers = [(member.name, member.model_path, member) for member in config.teachers.members]
        wrappers.append(f"route by {config.teachers.route_key}" if config.teachers.routes else "mixture")
    members = []
    for (name, model_path, teacher), (_, loss) in zip(teachers, config.teacher_losses(), strict=True):
        placement, detail = _placement(config, teacher.served)
        sends = _sends(loss.teacher_request(None), placement)
        members.append(PlannedMember(name, _source(config, model_path, teacher), placement, detail, sends))
    return TeacherPlan(tuple(members), tuple(wrappers))


def assemble_teacher(
    config: MasterConfig, tokenizer: Any, teacher_tokenizer: Any | None, members: Sequence[TeacherInterface]
) -> TeacherInterface:
    """The run's teacher around its ``members``, with the wrappers :func:`plan_teacher` lists.

    A cross-tokenizer teacher scores the re-tokenized response under its own prompt, which already holds the context.
    """
    with_context = config.distillation.teacher_context_spec() is not None
    if config.teachers is None:
        (teacher,) = members
        if teacher_tokenizer is not None:
            wrapped = CrossTokenizerTeacher(teacher, tokenizer, teacher_tokenizer)
            log.info(
                "teacher with its own tokenizer: compared on %d classes of tokens (the strings both vocabularies "
                "share, each with the tokens it prefixes); %.0f%% of the student's tokens fall in one",
                wrapped.classes.roots,
                100 * wrapped.classes.classified_fraction,
            )
            return wrapped
        return ContextTeacher(teacher, tokenizer.pad_token_id) if with_context else teacher
    if with_context:
        members = [ContextTeacher(member, tokenizer.pad_token_id) for member in members]
    names = [member.name for member in config.teachers.members]
    if config.teachers.routes:
        return RoutedTeachers(names, list(members))
    return TeacherMixture(names, list(members), getattr(config.loss_fn, "temperature", 1.0))
