"""Which models to load and how (the ``model``, ``teacher`` and ``teachers`` sections), and the optimizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from opd.data.teacher_choice import ROUTES_BY_MODE, TeacherChoice
from opd.models.teacher.backends import RemoteTeacherConfig as RemoteTeacherConfig
from opd.models.teacher.backends import TeacherBackendName, TeacherLoader, TeacherSourceConfig
from opd.models.teacher.self_teacher import FOLLOWING_TEACHERS, SelfTeacherName
from opd.utils.config import StrictConfig

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

    from opd.models.interfaces import TeacherInterface

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Qwen2 / Llama-style decoders."""

# Layers the fused loss and the merged refit read directly: an adapter there would be skipped.
_FORBIDDEN_LORA_TARGETS = ("lm_head", "embed_tokens")


class ModelLoadingConfig(StrictConfig):
    """How models are loaded, shared by every algorithm's ``model`` section."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    trust_remote_code: bool = False
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = None


class LoraConfig(StrictConfig):
    """Low-rank adapters on the student (``model.lora``), trained with ``peft`` instead of the full weights.

    The section's presence switches LoRA on: ``model.lora: null`` (the default) is full
    fine-tuning, and any given section (``model.lora: {r: 8}``, or an override such as
    ``model.lora.r=8`` or ``model.lora.enabled=true``) trains adapters only.
    ``enabled: false`` keeps the settings written down but trains the full model.
    """

    enabled: bool = Field(True, description="false = full fine-tuning despite the section")
    r: int = Field(16, ge=1, description="rank of each adapter")
    alpha: float = Field(32.0, gt=0.0, description="scaling numerator: the update is (alpha / r) · B·A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter input during training")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        description="module names (suffixes) that get adapters, or all-linear (every linear layer but the head)",
    )

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, str):
            return value
        if not value:
            raise ValueError("needs at least one module name (or all-linear)")
        forbidden = sorted(set(value) & set(_FORBIDDEN_LORA_TARGETS))
        if forbidden:
            raise ValueError(
                f"{forbidden} cannot take an adapter: the fused loss and the merged refit read the embedding and "
                "output layers' weights directly"
            )
        return value


class StudentLoraSettings(StrictConfig):
    """The ``lora`` key of a section that loads a trainable student."""

    lora: LoraConfig | None = Field(None, description="low-rank adapters (peft); null = full fine-tuning")

    def active_lora(self) -> LoraConfig | None:
        """The LoRA settings if LoRA is on (section given and ``enabled``), else None."""
        return self.lora if self.lora is not None and self.lora.enabled else None


class ModelConfig(ModelLoadingConfig, StudentLoraSettings):
    """Teacher, student and tokenizer locations plus loading options.

    Paths are Hugging Face hub names, local model directories, or ``tiny:<preset>``
    for the locally built tiny models of :mod:`opd.models.tiny`.
    """

    teacher_model_path: str | None = Field(
        None, description="teacher: hub name, local directory or tiny:<preset> (required unless teacher.backend=remote)"
    )
    student_model_path: str = Field(description="student: hub name, local directory or tiny:<preset>")
    tokenizer_path: str | None = Field(None, description="defaults to student_model_path")


class TeacherConfig(TeacherSourceConfig):
    """Where the teacher runs: in the trainer's process (``local``) or behind HTTP (``remote``).

    With ``model.teacher_model_path: student``, ``self_teacher`` says which of the student's
    weights the teacher scores with (:mod:`opd.models.teacher.self_teacher`, whose
    :func:`~opd.models.teacher.self_teacher.self_teacher_problem` says what it cannot run with).
    """

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


class OptimizerConfig(StrictConfig):
    """AdamW and learning-rate schedule settings."""

    learning_rate: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    adam_epsilon: float = Field(1e-8, gt=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="null disables clipping")
    warmup_steps: int = Field(0, ge=0)
    lr_scheduler: str = Field("constant_with_warmup", pattern="^(constant_with_warmup|linear|cosine)$")
    adam_implementation: Literal["auto", "fused", "foreach", "for_loop"] = Field(
        "auto", description="AdamW kernel: auto = fused where torch has it for the device, else foreach"
    )


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
    """Several teachers (``teachers:``): each example routed to one, or every token scored by a mixture.

    Set instead of ``model.teacher_model_path`` / ``teacher:``. Every member answers the
    signal ``loss_fn`` asks for; with routing, a distillation run may give a member an
    objective (and so a signal) of its own
    (:class:`~opd.algorithms.distillation_config.DistillationTeachersConfig`).
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
