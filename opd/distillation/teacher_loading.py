"""Loading and connecting the run's teachers, each checked against the run's tokenizer first.

:mod:`opd.distillation.teacher_plan` says which teacher answers and assembles it from these members."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from opd.distillation.config import MasterConfig
from opd.distillation.teacher_plan import assemble_teacher
from opd.losses.config import (
    FusedHeadSettings,
)
from opd.models.interfaces import (
    FullVocabRequest,
    GenerationInterface,
    TeacherInterface,
)
from opd.models.lm_head import output_layer_of
from opd.models.loading import (
    check_output_sizes,
    check_tokenizer_compatibility,
    load_causal_lm,
    load_output_layer,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from opd.run.validation import TeacherEngine
from opd.teachers.backends import RemoteTeacherConfig, model_in_process
from opd.teachers.config import TeacherMemberConfig
from opd.teachers.self_teacher import SELF_DISTILLATION_TEACHER
from opd.teachers.served.remote_generation import RemoteGeneration
from opd.teachers.served.remote_teacher import RemoteTeacher
from opd.utils.errors import ConfigError

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack
    from transformers import PreTrainedModel

log = logging.getLogger("opd")


def teacher_tokenizer_of(config: MasterConfig) -> Any | None:
    """The teacher's own tokenizer when it differs from the student's (``teacher.cross_tokenizer``), else None."""
    if not config.teacher.cross_tokenizer:
        return None
    tokenizer = load_tokenizer(resolve_teacher_path(config), config.model.trust_remote_code)
    if config.data.chat_template:  # the run's template override is for the student's tokenizer only
        log.info("data.chat_template applies to the student; the teacher renders prompts with its own template")
    return tokenizer


def resolve_teacher_path(config: MasterConfig) -> str:
    """The in-process teacher's model path; ``student`` means ``model.student_model_path`` as given.

    Never the checkpoint a run resumes from: a frozen self-teacher stays the initial student; an EMA one's average is
    restored from the checkpoint.

    Raises:
        ConfigError: without ``model.teacher_model_path``.
    """
    path = config.model.teacher_model_path
    if path is None:
        raise ConfigError("model.teacher_model_path is required for an in-process teacher")
    return _model_path(config, path)


def _model_path(config: MasterConfig, path: str) -> str:
    """``path``, or ``model.student_model_path`` where it is ``student`` (the student's starting point)."""
    return config.model.student_model_path if path == SELF_DISTILLATION_TEACHER else path


class RunTeacherLoader:
    """How this run loads and connects teachers (:class:`~opd.teachers.backends.TeacherLoader`).

    ``student_path`` is named in tokenizer mismatches; ``own_tokenizer`` is a cross-tokenizer teacher's.
    """

    def __init__(self, config: MasterConfig, tokenizer: Any, student_path: str, own_tokenizer: Any | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.student_path = student_path
        self.own_tokenizer = own_tokenizer

    def load(self, path: str) -> PreTrainedModel:
        """The frozen teacher at ``path`` (``student``: the student's starting point), its tokenizer and head checked.

        Raises:
            ModelCompatibilityError: its tokenizer (unless it has ``own_tokenizer``) or output layer does not match.
            ConfigError: a head the fused loss cannot take.
        """
        config = self.config
        teacher_path = _model_path(config, path)
        device = resolve_device(config.model.device)
        dtype = resolve_dtype(config.model.dtype, device)
        # Checked even when model.tokenizer_path overrides the student's: its logits are indexed by its own ids.
        if self.own_tokenizer is None:
            teacher_tokenizer = load_tokenizer(teacher_path, config.model.trust_remote_code)
            check_tokenizer_compatibility(self.tokenizer, teacher_tokenizer, self.student_path, teacher_path)
        log.info("loading teacher %s (%s on %s)", teacher_path, str(dtype).replace("torch.", ""), device)
        model = load_causal_lm(teacher_path, dtype, device, config.model)
        own = self.own_tokenizer if self.own_tokenizer is not None else self.tokenizer
        check_output_sizes(model, len(own), teacher_path)
        check_fusable(config, None, model)
        return model

    def connect(self, remote: RemoteTeacherConfig, model_path: str | None) -> RemoteTeacher:
        """The served teacher's client (:func:`connect_remote_teacher`)."""
        return connect_remote_teacher(
            self.config, self.tokenizer, remote, None if model_path is None else _model_path(self.config, model_path)
        )


def check_fusable(config: MasterConfig, student: PreTrainedModel | None, teacher: PreTrainedModel | None) -> None:
    """Raises ConfigError before training unless each head is linear with a known logit transform (multiplier, cap)."""
    if not (isinstance(config.loss_fn, FusedHeadSettings) and config.loss_fn.fused_lm_head):
        return
    # A served teacher's head is checked when it connects.
    for model, name in ((student, "the student"), (teacher, "the teacher")):
        try:
            if model is not None:
                output_layer_of(model, name)
        except ValueError as error:
            raise ConfigError(f"{error}; set loss_fn.fused_lm_head = false") from None


def connect_remote_teacher(
    config: MasterConfig, tokenizer: Any, remote: RemoteTeacherConfig | None = None, model_path: str | None = None
) -> RemoteTeacher:
    """The served teacher's client, after checking that it answers and tokenizes like ``tokenizer``.

    A full-vocabulary loss also loads the output layer alone from ``model_path`` (default ``model.teacher_model_path``);
    on a cluster, each trainer worker binds the hidden states to its own copy instead. ``remote`` defaults to
    ``teacher.remote``.
    """
    remote = remote or config.teacher.remote
    if remote.url is None:
        raise ConfigError("teacher.backend = remote needs teacher.remote.url")
    output_layer = None
    if isinstance(config.loss_fn.teacher_request(None), FullVocabRequest):
        # The server sends hidden states; the exact logits are made here with its output layer.
        device = resolve_device(config.model.device)
        output_layer = load_output_layer(
            model_path or resolve_teacher_path(config),
            resolve_dtype(config.model.dtype, device),
            device,
            config.model.trust_remote_code,
        )
    client = RemoteTeacher(
        remote.url,
        remote.model,
        os.environ.get(remote.api_key_env) if remote.api_key_env else None,
        remote.max_concurrency,
        remote.sequences_per_request,
        remote.timeout_s,
        remote.max_retries,
        remote.backoff_s,
        remote.protocol,
        remote.hidden_dtype,
        output_layer,
        binds_output_layer=config.cluster is None,
    )
    client.connect(teacher_tokenizer_of(config) or tokenizer)
    log.info("teacher: %s served at %s", client.model, remote.url)
    return client


def load_teacher_members(
    config: MasterConfig,
    tokenizer: Any,
    loaded: TeacherInterface | None = None,
    ready: dict[str, TeacherInterface] | None = None,
    student_path: str | None = None,
) -> list[TeacherInterface]:
    """The run's teachers before :func:`~opd.distillation.teacher_plan.assemble_teacher` puts them together.

    The one teacher: ``loaded``, else its served client. Several: each member in order, taken from ``ready``
    (pools, connected servers) or loaded or connected here.
    """
    student_path = student_path or config.model.student_model_path
    if config.teachers is None:
        if loaded is not None:
            return [loaded]
        return [
            config.teacher.build(RunTeacherLoader(config, tokenizer, student_path, teacher_tokenizer_of(config)), None)
        ]
    ready = ready or {}
    loader = RunTeacherLoader(config, tokenizer, student_path)
    members = [
        ready[member.name] if member.name in ready else member.build(loader, member.model_path)
        for member in config.teachers.members
    ]
    names = [member.name for member in config.teachers.members]
    log.info("%d teachers (%s): %s", len(names), config.teachers.mode, ", ".join(names))
    return members


def assemble_in_worker(
    config: MasterConfig, tokenizer: Any, teacher_tokenizer: Any | None, loaded: list[TeacherInterface]
) -> TeacherInterface:
    """The run's teacher in a trainer worker, around ``loaded`` (in :func:`_cluster_teacher_paths`'s order).

    Served members connect from the worker and bind their output layer there.
    """
    members = loaded
    if config.teachers is not None:
        local = [member.name for member in config.teachers.members if not member.served]
        here = config.model_copy(update={"cluster": None})
        members = load_teacher_members(here, tokenizer, ready=dict(zip(local, loaded, strict=True)))
    return assemble_teacher(config, tokenizer, teacher_tokenizer, members)


def member_teacher_path(config: MasterConfig, member: TeacherMemberConfig) -> str:
    """A local member's model path (``student``: the student's starting point)."""
    assert member.model_path is not None  # checked with the config
    return _model_path(config, member.model_path)


def teacher_engines(
    config: MasterConfig,
    tokenizer: Any,
    teacher_tokenizer: Any | None,
    engine_in_run: Callable[[str | None, Any], GenerationInterface],
) -> list[TeacherEngine]:
    """The teachers that answer the validation prompts for the baselines (none unless one is asked for).

    A served teacher answers from its server (:class:`RemoteGeneration`); others from ``engine_in_run(name,
    tokenizer)`` (``name`` None for the one teacher). A cross-tokenizer teacher samples in its own tokens; with
    routing, each member answers the prompts routed to it.
    """
    validation = config.validation
    if not (validation.teacher_baseline or validation.eval_baseline):
        return []
    with_context = config.distillation.teacher_context_spec() is not None
    if config.teachers is None:
        own = teacher_tokenizer if teacher_tokenizer is not None else tokenizer
        prompt_key: Literal["prompt_ids", "teacher_prompt_ids"] = (
            "teacher_prompt_ids" if with_context or teacher_tokenizer is not None else "prompt_ids"
        )
        served = config.teacher.served
        generation = RemoteGeneration.from_config(config.teacher.remote, own) if served else engine_in_run(None, own)
        return [TeacherEngine(generation, None, own, prompt_key)]
    routes = config.teachers.routes
    return [
        TeacherEngine(
            RemoteGeneration.from_config(member.remote, tokenizer)
            if member.served
            else engine_in_run(member.name, tokenizer),
            member.name,
            tokenizer,
            "teacher_prompt_ids" if with_context else "prompt_ids",
            position if routes else None,
        )
        for position, member in enumerate(config.teachers.members)
    ]


def _teacher_models_in_process(config: MasterConfig, members: list[TeacherInterface]) -> dict[str | None, Any]:
    """The in-process teachers' models, by name (None for the one teacher); served teachers have none."""
    names = [None] if config.teachers is None else [member.name for member in config.teachers.members]
    return {
        name: model
        for name, member in zip(names, members, strict=True)
        if (model := model_in_process(member)) is not None
    }
