"""The ``teacher`` and ``teachers`` sections: where the teacher runs, and several teachers' routing or mixture."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from opd.data.teacher_choice import ROUTES_BY_MODE, TeacherChoice
from opd.teachers.backends import TeacherBackendName, TeacherLoader, TeacherSourceConfig
from opd.teachers.self_teacher import FOLLOWING_TEACHERS, SelfTeacherName
from opd.utils.config import StrictConfig

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

    from opd.models.interfaces import TeacherInterface


class TeacherConfig(TeacherSourceConfig):
    """The teacher runs in process (``local``), behind HTTP (``remote``), or is the student (``self_teacher``)."""

    backend: TeacherBackendName = Field("local", description="local = model.teacher_model_path in process")
    cross_tokenizer: bool = Field(
        False,
        description="the teacher's tokenizer differs from the student's: it scores the response text under its own "
        "tokenization, aligned by bytes (loss_fn.type topk; its tokenizer is read from model.teacher_model_path)",
    )
    self_teacher: SelfTeacherName = Field(
        "frozen",
        description="model.teacher_model_path = student: frozen = a copy of the student's initial weights; live = "
        "the student's current weights (its own module, no copy); ema = a copy following the student's weights by "
        "an exponential moving average (ema_decay)",
    )
    ema_decay: float = Field(
        0.99, gt=0.0, lt=1.0, description="self_teacher = ema: θ_T ← d·θ_T + (1 − d)·θ_S after every optimizer step"
    )

    @property
    def follows_student(self) -> bool:
        """The teacher is built on the student and follows its weights (``self_teacher`` live or ema)."""
        return self.self_teacher in FOLLOWING_TEACHERS

    def build_following(self, loader: TeacherLoader, student: PreTrainedModel) -> TeacherInterface:
        """The teacher that follows ``student`` (the student's module, loaded already), as ``self_teacher`` says."""
        build = FOLLOWING_TEACHERS[self.self_teacher].build
        return build(loader, student, self.ema_decay, self.share_prompt_forward)


class TeacherMemberConfig(TeacherSourceConfig):
    """One of several teachers (``teachers.members[i]``): its name and where it runs."""

    name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$", description="used in routing, weights and metric names")
    model_path: str | None = Field(
        None,
        description="hub name, local directory or tiny:<preset>; required in process, and for a served "
        "teacher's full-vocabulary loss (its output layer)",
    )
    backend: TeacherBackendName = Field("local", description="local = model_path in process")
    weight: float = Field(1.0, ge=0.0, description="mixture: fixed weight (normalised over the members)")


class TeachersConfig(StrictConfig):
    """Several teachers (``teachers:``, instead of ``model.teacher_model_path`` / ``teacher:``): routed or mixed.

    Every member answers the signal ``loss_fn`` asks for; when routing, a distillation run may give a member an
    objective of its own (:class:`~opd.distillation.config.DistillationTeachersConfig`).
    """

    mode: Literal["route", "mixture"] = Field(
        description="route = each example to one teacher; mixture = the student matches Σ_i w_i p_i"
    )
    members: Sequence[TeacherMemberConfig] = Field(min_length=1, description="the teachers, each with a unique name")
    route_key: str | None = Field(None, description="route: the dataset field naming each example's teacher")
    route_map: dict[str, str] | None = Field(
        None, description="route: field value -> teacher name (null: the field holds teacher names)"
    )
    default: str | None = Field(None, description="route: the teacher of examples without a (mapped) field value")
    weights_key: str | None = Field(
        None, description="mixture: dataset field with per-example {teacher name: weight}; null = members' weight"
    )

    @property
    def routes(self) -> bool:
        """Each example goes to one teacher (``mode: route``); otherwise every token meets the mixture."""
        return ROUTES_BY_MODE[self.mode]

    @model_validator(mode="after")
    def _consistent(self) -> TeachersConfig:
        names = [member.name for member in self.members]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"teachers.members: the names {repeated} are used more than once")
        if self.routes:
            if self.route_key is None:
                raise ValueError(
                    "teachers.mode = route needs teachers.route_key (the dataset field naming the teacher)"
                )
            if self.weights_key is not None:
                raise ValueError("teachers.weights_key is for teachers.mode = mixture")
            for key, name in [
                ("teachers.default", self.default),
                *[(f"teachers.route_map.{value}", target) for value, target in (self.route_map or {}).items()],
            ]:
                if name is not None and name not in names:
                    raise ValueError(f"{key} = {name!r} names no teacher; teachers.members are {', '.join(names)}")
        else:
            stray = [key for key in ("route_key", "route_map", "default") if getattr(self, key) is not None]
            if stray:
                raise ValueError(f"teachers.{stray[0]} is for teachers.mode = route")
            if self.weights_key is None and sum(member.weight for member in self.members) <= 0:
                raise ValueError("teachers.members[*].weight: the fixed weights must have a positive sum")
        return self

    def choice(self) -> TeacherChoice:
        """How each example is assigned its teacher(s) (read when the data is loaded)."""
        return TeacherChoice(
            names=tuple(member.name for member in self.members),
            mode=self.mode,
            route_key=self.route_key,
            route_map=self.route_map,
            default=self.default,
            weights=tuple(member.weight for member in self.members),
            weights_key=self.weights_key,
        )
