"""The configuration of a distillation run: one YAML file, validated into :class:`MasterConfig`.

Every key is documented in ``examples/configs/distillation.yaml``. :class:`MasterConfig` checks across sections, so a
conflicting config stops before any file is read; a key listed in :data:`MOVED_KEYS` gets an error naming its place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from opd.data.config import DataConfig
from opd.data.teacher_context import TeacherContext
from opd.distillation.lambda_schedule import LambdaSchedule
from opd.distributed.config import ClusterConfig
from opd.losses.config import (
    FullVocabLossConfig,
    FusedHeadSettings,
    LossFnConfig,
)
from opd.losses.off_policy import OffPolicyCorrectionConfig
from opd.models.config import ModelConfig
from opd.models.decoding import GenerateStrategyConfig
from opd.models.interfaces import FullVocabRequest, TeacherRequest
from opd.rollout.engines import GenerationConfig
from opd.rollout.environments.config import EnvironmentConfig
from opd.run.checkpoint import CheckpointingConfig
from opd.run.logger import LoggerConfig
from opd.run.training_loop import RunConfig, TrainingLoopConfig
from opd.run.validation import ValidationConfig
from opd.teachers.backends import TeacherSourceConfig
from opd.teachers.config import TeacherConfig, TeacherMemberConfig, TeachersConfig
from opd.teachers.self_teacher import SelfTeacherSetting, self_teacher_problem
from opd.teachers.served.remote_teacher import protocol_refusal
from opd.utils.config import StrictConfig
from opd.utils.errors import ConfigError
from opd.utils.refusals import Check, Finding, Refusal, first_problem

MOVED_KEYS: dict[str, str] = {
    "distillation.kl_type": "loss_fn.kl_type",
    "distillation.mixed_kl_weight": "loss_fn.mixed_kl_weight",
    "distillation.kl_temperature": "loss_fn.temperature",
    "distillation.kl_reduction": "loss_fn.reduction",
    "loss_fn.teacher_topk": "loss_fn.k (with loss_fn.type: topk) or loss_fn.metrics_topk (full_vocab, jsd)",
    "loss_fn.topk_tail": "loss_fn.tail (with loss_fn.type: topk)",
    "loss_fn.divergence": "loss_fn.type (jsd for the generalized JSD, full_vocab for the KL)",
    "loss_fn.jsd_beta": "loss_fn.beta (with loss_fn.type: jsd)",
}
"""Old key → where it lives now (the loss became one typed ``loss_fn`` choice)."""


class DistillationConfig(StrictConfig):
    """The distillation strategy: the λ coin, on-policy sampling, the teacher-only context and the fixed data's
    cached teacher signal."""

    lambda_: Annotated[float, Field(ge=0.0, le=1.0)] | LambdaSchedule = Field(
        1.0,
        alias="lambda",
        description="probability that a step uses the student's own samples: a number, or a schedule "
        "({schedule: linear | step, start, end, steps})",
    )
    mask_prompt_tokens: bool = True
    num_samples_per_prompt: int = Field(1, ge=1)
    generate_strategy: GenerateStrategyConfig = Field(default_factory=GenerateStrategyConfig)
    teacher_context: str | None = Field(
        None, description="context distillation: text only the teacher sees, inserted into every prompt"
    )
    teacher_context_key: str | None = Field(
        None, description="context distillation: dataset field holding a per-example teacher-only context"
    )
    teacher_context_placement: Literal["user_prefix", "system"] = Field(
        "user_prefix", description="user_prefix = before the first user message; system = as / in the system message"
    )
    teacher_context_separator: str = Field("\n\n", description="between the context and the text after it")
    teacher_signal_cache: bool = Field(
        True,
        description="true: fixed-data steps read the teacher's signal from the cache beside data.train_path (its "
        "name + .teacher_signal, written by opd generate with generate.teacher_signal) where it holds what the loss "
        "asks of this teacher, else the teacher scores (a log line says why); false: the teacher always scores",
    )

    @model_validator(mode="after")
    def _check_samples_can_differ(self) -> DistillationConfig:
        """Greedy decoding makes every sample of a prompt the same: n copies cost n times and teach nothing new."""
        if self.num_samples_per_prompt > 1 and self.generate_strategy.is_greedy:
            raise ValueError(
                f"distillation.num_samples_per_prompt = {self.num_samples_per_prompt} with "
                "distillation.generate_strategy.decoding_method = greedy gives identical copies of each response; "
                "sample instead (decoding_method: top_k or top_p) or set num_samples_per_prompt = 1"
            )
        return self

    @property
    def has_teacher_context(self) -> bool:
        """Whether the teacher reads a teacher-only context (``teacher_context`` or ``teacher_context_key``)."""
        return self.teacher_context_spec() is not None

    def teacher_context_spec(self) -> TeacherContext | None:
        """The teacher-only context these keys describe, or None without one."""
        if self.teacher_context is None and self.teacher_context_key is None:
            return None
        return TeacherContext(
            self.teacher_context,
            self.teacher_context_key,
            self.teacher_context_placement,
            self.teacher_context_separator,
        )

    def lambda_at(self, step: int) -> float:
        """λ of optimizer step ``step`` (1-based): the number, or the schedule's value there."""
        return self.lambda_ if isinstance(self.lambda_, float) else self.lambda_.at(step)

    def lambda_is_scheduled(self) -> bool:
        """Whether λ changes with the step (a schedule rather than a number)."""
        return not isinstance(self.lambda_, float)

    def lowest_lambda(self) -> float:
        """The smallest λ of any step: below 1, some steps train on fixed data."""
        return self.lambda_ if isinstance(self.lambda_, float) else self.lambda_.lowest()


DEPTHS = {"sync": 0, "one_step_off": 1, "two_step_off": 2}
"""How many steps ahead of the update each ``training.scheduler`` samples: from 1 sampling overlaps the
update, from 2 the teacher also scores the next batch while the student trains."""


class TrainingConfig(TrainingLoopConfig):
    """Loop, batch and optimizer settings (``training.*``)."""

    batch_size: int = Field(8, ge=1, description="prompts per optimizer step")
    micro_batch_size: int | None = Field(
        None, ge=1, description="sequences per forward/backward pass (a step's sequences sorted by length first)"
    )
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="padded-token budget per forward/backward pass (length-sorted dynamic batching)"
    )
    sequence_packing: bool = Field(False, description="pack each micro-batch into one padding-free row")
    gradient_accumulation_steps: int | None = Field(None, ge=1, description="micro-batches per optimizer step")
    scheduler: Literal["sync", "one_step_off", "two_step_off"] = Field(
        "sync",
        description="sync = sample, score and train in turn; one_step_off = sample the next batch while the "
        "student trains; two_step_off = also score the next batch while the student trains",
    )
    off_policy_correction: OffPolicyCorrectionConfig = Field(default_factory=OffPolicyCorrectionConfig)

    @property
    def depth(self) -> int:
        """How many steps ahead of the update ``scheduler`` samples (:data:`DEPTHS`)."""
        return DEPTHS[self.scheduler]

    @property
    def asynchronous(self) -> bool:
        """Whether rollouts are sampled ahead of the update (one_step_off, two_step_off)."""
        return self.depth > 0

    @property
    def scores_ahead(self) -> bool:
        """Whether the teacher scores the next batch while the student trains (two_step_off)."""
        return self.depth > 1

    def correction_is_on(self, loss: LossFnConfig) -> bool:
        """Whether ``loss``'s stale samples are weighted; ``auto``: per the objective, and never under sync."""
        return self.off_policy_correction.is_on(self.asynchronous, loss.weighs_stale_samples_by_default)


class DistillationValidationConfig(ValidationConfig):
    """Validation settings of a distillation run (adds the baselines and ``opd eval``'s model)."""

    teacher_baseline: bool = Field(False, description="once, before training: the teacher answers the val prompts")
    eval_baseline: bool = Field(
        False,
        description="once, before training: student without and teacher with the teacher-only context "
        "answer the val prompts (val/baseline_*)",
    )
    teacher_topk: int = Field(
        64,
        ge=1,
        description="k of the top-k KL that validation reports when the teacher cannot send its full "
        "vocabulary as configured and the loss is not top-k (a top-k loss's own k is used)",
    )
    model_path: str | None = Field(
        None, description="model evaluated by `opd eval` / val_only: a model dir or step_N checkpoint"
    )


class DistillationTeacherMemberConfig(TeacherMemberConfig):
    """One of several teachers, with the objective (and so the signal) it is distilled with."""

    loss_fn: LossFnConfig | None = Field(
        None,
        description="route: this teacher's own objective and signal (e.g. topk for a served teacher next to a "
        "full_vocab one); null = the run's loss_fn",
    )


class DistillationTeachersConfig(TeachersConfig):
    """``teachers:`` in a distillation run: the members may have objectives of their own (routing)."""

    members: Sequence[DistillationTeacherMemberConfig] = Field(
        min_length=1, description="the teachers, each with a unique name"
    )

    @model_validator(mode="after")
    def _own_objectives_route(self) -> DistillationTeachersConfig:
        if not self.routes:
            for index, member in enumerate(self.members):
                if member.loss_fn is not None:
                    raise ValueError(
                        f"teachers.members[{index}].loss_fn: a mixture compares the student with one mixed "
                        "distribution, so every teacher answers the run's loss_fn; remove it (or use mode route)"
                    )
        return self


class MasterConfig(RunConfig):
    """The whole run's configuration (one YAML file)."""

    moved_keys: ClassVar[dict[str, str]] = MOVED_KEYS

    output_dir: str = Field("results/distillation", description="final model, logs and checkpoints go here")
    val_only: bool = Field(False, description="run validation on validation.model_path (or the student) and exit")
    model: ModelConfig
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    teachers: DistillationTeachersConfig | None = Field(
        None, description="several teachers (routing or mixture) instead of model.teacher_model_path / teacher"
    )
    distillation: DistillationConfig = Field(default_factory=DistillationConfig)
    loss_fn: LossFnConfig = Field(default_factory=FullVocabLossConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    data: DataConfig
    validation: DistillationValidationConfig = Field(default_factory=DistillationValidationConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    cluster: ClusterConfig | None = Field(
        None, description="run on Ray worker groups (FSDP2 student, rollout, teacher); null = in this process"
    )
    environment: EnvironmentConfig | None = Field(
        None, description="multi-turn rollouts: the student acts in an environment (tools); null = one turn per rollout"
    )

    def teacher_losses(self) -> list[tuple[str, LossFnConfig]]:
        """Each teacher's objective with its key: ``loss_fn`` for one teacher, and for members without their own."""
        if self.teachers is None:
            return [("loss_fn", self.loss_fn)]
        return [
            (f"teachers.members[{index}].loss_fn", member.loss_fn)
            if member.loss_fn is not None
            else ("loss_fn", self.loss_fn)
            for index, member in enumerate(self.teachers.members)
        ]

    def has_validation_data(self) -> bool:
        """Whether ``data`` names validation data (a file or a holdout)."""
        return self.data.has_validation

    def model_loading(self) -> ModelConfig:
        return self.model

    def harness_comparisons(self) -> dict[str, str]:
        """The starting student, and the teacher where it is one model directory (not served, not several)."""
        models = {"student_before": self.model.student_model_path}
        if self.teachers is None and self.model.teacher_model_path is not None:
            models["teacher"] = self.model.teacher_model_path
        return models

    def validation_metrics(self) -> tuple[str, ...]:
        """The metrics a distillation run's validation reports: the student's, and its KLs to the teacher."""
        return (*super().validation_metrics(), "val/kl_forward", "val/kl_reverse")

    def teacher_target_problem(self) -> str | None:
        """``training.early_stop.target = teacher`` reaches the teacher baseline's value, so that must run."""
        if self.validation.teacher_baseline:
            return None
        return (
            "training.early_stop.target = teacher reaches the teacher's own validation value, which "
            "validation.teacher_baseline measures; set validation.teacher_baseline = true"
        )

    @model_validator(mode="after")
    def _check_across_sections(self) -> MasterConfig:
        """Combinations that span sections (each message names the keys that conflict)."""
        problem = first_problem(_ACROSS_SECTIONS, self)
        if problem is not None:
            raise ValueError(problem)
        return self


def _loss_problem(config: MasterConfig) -> str | None:
    """What each chosen objective needs from the λ coin, and what the teachers' objectives must share."""
    lambda_ = config.distillation.lowest_lambda()
    for key, loss in config.teacher_losses():
        problem = loss.lambda_problem(key, lambda_)  # each objective states its own limit
        if problem is not None:
            return problem
        if _fused(loss) != _fused(config.loss_fn):
            return _fused_mismatch(key, loss, config.loss_fn)
    return None


def _fused_mismatch(key: str, loss: LossFnConfig, loss_fn: LossFnConfig) -> str:
    """A teacher's objective and ``loss_fn`` disagree on whether the student sends logits or hidden states."""
    settable = key if isinstance(loss, FusedHeadSettings) else "loss_fn"
    return (
        f"{key} takes the student's {'hidden states' if _fused(loss) else 'logits'} but loss_fn takes its "
        f"{'hidden states' if _fused(loss_fn) else 'logits'}: the student's output is computed once "
        f"for every teacher; set {settable}.fused_lm_head so that both agree"
    )


def _fused(loss: LossFnConfig) -> bool:
    """Whether the objective takes the student's final hidden states and head (the fused loss)."""
    return isinstance(loss, FusedHeadSettings) and loss.fused_lm_head


def _self_teacher_setting(config: MasterConfig) -> SelfTeacherSetting:
    """``teacher.self_teacher`` with the settings it must agree with."""
    teacher = config.teacher
    return SelfTeacherSetting(
        teacher.self_teacher,
        config.model.teacher_model_path,
        teacher.served,
        several=config.teachers is not None,
        cross_tokenizer=teacher.cross_tokenizer,
        on_cluster=config.cluster is not None,
        scores_ahead=config.training.scores_ahead,
        has_context=config.distillation.has_teacher_context,
    )


@dataclass(frozen=True)
class _Teacher:
    """One teacher as the messages name it (``where``: ``teacher`` or ``teachers.members[i]``), and the
    objective it is distilled with (``loss_key`` names it)."""

    source: TeacherSourceConfig
    model_path: str | None
    where: str
    model_path_key: str
    which: str
    loss_key: str
    objective: LossFnConfig

    @property
    def loss(self) -> str:
        return f"{self.loss_key}.type = {self.objective.type}"

    @property
    def request(self) -> TeacherRequest:
        return self.objective.teacher_request(None)

    @property
    def served_full_vocab(self) -> bool:
        """A served teacher asked for the full vocabulary: its hidden states over the wire, its output layer here."""
        return self.source.served and isinstance(self.request, FullVocabRequest)


def _teachers(config: MasterConfig) -> list[_Teacher]:
    """The run's teacher, or each of its several teachers, with the objective each is distilled with."""
    if config.teachers is None:
        which = "'student' = the student's own model, teacher.self_teacher says which weights"
        path = config.model.teacher_model_path
        return [_Teacher(config.teacher, path, "teacher", "model.teacher_model_path", which, "loss_fn", config.loss_fn)]
    return [
        _Teacher(
            member,
            member.model_path,
            f"teachers.members[{i}]",
            f"teachers.members[{i}].model_path",
            f"teacher {member.name!r}",
            *loss,
        )
        for i, (member, loss) in enumerate(zip(config.teachers.members, config.teacher_losses(), strict=True))
    ]


_EACH_TEACHER: tuple[Check[_Teacher], ...] = (
    Refusal(
        lambda teacher: not teacher.source.served and teacher.model_path is None,
        lambda teacher: f"{teacher.model_path_key} is required with {teacher.where}.backend = local ({teacher.which})",
    ),
    lambda teacher: teacher.source.teacher_backend.problem(teacher.source, teacher.model_path, teacher.where),
    Finding(
        lambda teacher: (
            protocol_refusal(teacher.source.remote.protocol, teacher.request) if teacher.served_full_vocab else None
        ),
        lambda teacher, missing: (
            f"{teacher.loss} with a served teacher needs {missing}; set "
            f"{teacher.where}.remote.protocol = opd (opd serve-teacher) or auto, or use loss_fn.type = topk"
        ),
    ),
    Refusal(
        lambda teacher: teacher.served_full_vocab and teacher.model_path is None,
        lambda teacher: (
            f"{teacher.loss} with a served teacher applies the teacher's output layer here: set "
            f"{teacher.model_path_key} to the served model's directory (only its output layer is read)"
        ),
    ),
    Finding(
        lambda teacher: teacher.source.teacher_backend.unsupported_reason(teacher.request),
        lambda teacher, reason: (
            f"{teacher.where}.backend = {teacher.source.backend} cannot serve {teacher.loss}: "
            f"{reason}; choose settings that teacher can answer (a served teacher answers loss_fn.type = topk at "
            "temperature 1, and sampled_token)"
        ),
    ),
)
"""What one teacher, where it runs, must have to answer the signal its objective asks for."""


def _teachers_problem(config: MasterConfig) -> str | None:
    """The first of :data:`_EACH_TEACHER`'s problems of any teacher, the teachers in order."""
    problems = (first_problem(_EACH_TEACHER, teacher) for teacher in _teachers(config))
    return next((problem for problem in problems if problem is not None), None)


def _generation_problem(config: MasterConfig) -> str | None:
    """What the rollout engine says it cannot do as configured (its own messages)."""
    generation = config.generation
    colocated = config.cluster is not None and config.cluster.colocated
    key = "distillation.generate_strategy.max_length"
    max_length = config.distillation.generate_strategy.max_length
    problems = generation.engine.config_problems(generation, max_length, key, colocated)
    return problems[0] if problems else None


def _teacher_in_workers(config: MasterConfig) -> bool:
    """Whether a teacher runs inside the trainer workers (in process, not in a pool of its own)."""
    members = config.teachers.members if config.teachers is not None else [config.teacher]
    return config.cluster is not None and not config.cluster.teacher.in_pool and not all(m.served for m in members)


_ACROSS_SECTIONS: tuple[Check[MasterConfig], ...] = (
    _loss_problem,
    lambda config: self_teacher_problem(_self_teacher_setting(config)),
    Refusal(
        lambda config: config.distillation.has_teacher_context and not config.distillation.mask_prompt_tokens,
        "distillation.teacher_context: the teacher's prompt differs from the student's, so only "
        "completion tokens can be scored; set distillation.mask_prompt_tokens = true",
    ),
    Refusal(
        lambda config: config.validation.eval_baseline and not config.distillation.has_teacher_context,
        "validation.eval_baseline compares the student without and the teacher with the "
        "teacher-only context; set distillation.teacher_context or teacher_context_key",
    ),
    # Several teachers (teachers:) replace the one teacher's keys.
    Refusal(
        lambda config: config.teachers is not None and config.teacher.cross_tokenizer,
        "teacher.cross_tokenizer is for one teacher; several teachers must share the student's tokenizer",
    ),
    Refusal(
        lambda config: config.teachers is not None and config.model.teacher_model_path is not None,
        "model.teacher_model_path and teachers: are two ways to name the teacher; with several teachers set "
        "teachers.members[*].model_path and leave model.teacher_model_path unset",
    ),
    Refusal(
        lambda config: config.teachers is not None and (config.teacher.served or config.teacher.remote.url is not None),
        "teacher: is for one teacher; with teachers:, set teachers.members[*].backend and remote instead",
    ),
    Refusal(
        lambda config: (
            config.teachers is not None
            and config.training.early_stop is not None
            and config.training.early_stop.targets_teacher
        ),
        "training.early_stop.target = teacher: several teachers have no one teacher value (the baseline reports "
        "val/teacher_<name>_* for each); give a number as the target",
    ),
    # A teacher with another tokenizer answers top-k over shared strings.
    Refusal(
        lambda config: (
            config.teachers is None and config.teacher.cross_tokenizer and not config.loss_fn.compares_across_tokenizers
        ),
        lambda config: (
            "teacher.cross_tokenizer maps the teacher's top-k onto the student's vocabulary; "
            f"loss_fn.type = {config.loss_fn.type} is not supported with it, use loss_fn.type = topk"
        ),
    ),
    Refusal(
        lambda config: (
            config.teachers is None and config.teacher.cross_tokenizer and config.model.teacher_model_path is None
        ),
        "teacher.cross_tokenizer reads the teacher's tokenizer from model.teacher_model_path; set it",
    ),
    _teachers_problem,
    _generation_problem,
    Refusal(
        lambda config: (
            config.cluster is not None
            and config.cluster.trainer.offload_during_generation
            and not config.cluster.colocated
        ),
        "cluster.trainer.offload_during_generation frees the trainer's devices for the rollout engines, which "
        "share them only with cluster.placement = colocated; set it, or switch the offload off",
    ),
    lambda config: (
        config.cluster.teacher.engine_problem(config.loss_fn.teacher_request(None), config.cluster.colocated)
        if config.cluster is not None
        else None
    ),
    # What an asynchronous schedule overlaps needs devices or workers of its own.
    Refusal(
        lambda config: config.cluster is not None and config.cluster.colocated and config.training.asynchronous,
        lambda config: (
            f"training.scheduler = {config.training.scheduler} overlaps sampling with training, so the "
            "rollout workers need devices of their own; set cluster.placement = split"
        ),
    ),
    Refusal(
        lambda config: config.training.scores_ahead and _teacher_in_workers(config),
        lambda config: (
            f"training.scheduler = {config.training.scheduler} scores the next batch while the student "
            "trains, but a teacher colocated in the trainer workers runs on those same workers, which are busy "
            "training; set cluster.teacher.placement = pool (or serve the teacher), or use one_step_off"
        ),
    ),
)
"""The checks across sections, in the order they are tried (the first problem found is reported)."""


def resolve_micro_batching(config: MasterConfig) -> tuple[int, int]:
    """``(micro_batch_size, gradient_accumulation_steps)`` for ``batch_size × num_samples_per_prompt`` sequences.

    As in DeepSpeed, either knob may be given and the other is derived; both given must multiply to that number.

    Raises:
        ConfigError: the knobs disagree, do not divide the batch, or are set beside ``micro_batch_tokens``.
    """
    training = config.training
    sequences = training.batch_size * config.distillation.num_samples_per_prompt
    micro, accumulation = training.micro_batch_size, training.gradient_accumulation_steps
    if training.micro_batch_tokens is not None and (micro is not None or accumulation is not None):
        raise ConfigError(
            "training.micro_batch_tokens forms micro-batches by a token budget; set training.micro_batch_size "
            "and training.gradient_accumulation_steps to null when you use it"
        )
    if micro is None:
        if accumulation is None:
            return sequences, 1
        if sequences % accumulation:
            raise ConfigError(
                f"training.gradient_accumulation_steps = {accumulation} must divide batch_size × "
                f"num_samples_per_prompt = {sequences}"
            )
        return sequences // accumulation, accumulation
    if accumulation is None:
        return micro, math.ceil(sequences / micro)
    if micro * accumulation != sequences:
        raise ConfigError(
            f"training.micro_batch_size ({micro}) × training.gradient_accumulation_steps ({accumulation}) "
            f"must equal batch_size × num_samples_per_prompt = {sequences}; set only one of them"
        )
    return micro, accumulation
