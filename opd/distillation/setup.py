"""Building a distillation run's components from its config: :func:`setup`.

The machine's needs (vLLM, a compiler, an API key) and the data are checked before any model loads, so a malformed
line fails in seconds, not after loading a 32B teacher; a served teacher is reached before the student loads.
"""

from __future__ import annotations

import functools
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from opd.data.dataloaders import PreparedExample, make_eval_dataloader, make_train_dataloader
from opd.distillation.config import MasterConfig, resolve_micro_batching
from opd.distillation.teacher_loading import (
    RunTeacherLoader,
    _teacher_models_in_process,
    assemble_in_worker,
    check_fusable,
    connect_remote_teacher,
    load_teacher_members,
    member_teacher_path,
    resolve_teacher_path,
    teacher_engines,
    teacher_tokenizer_of,
)
from opd.distillation.teacher_plan import assemble_teacher, plan_teacher
from opd.losses.config import (
    FullVocabKernelSettings,
    HybridFullVocabLossConfig,
    SampledTokenLossConfig,
)
from opd.losses.distillation_losses import DistillationLossFn, TopKKLLossFn
from opd.losses.hybrid_loss import FullVocabHybridLossFn
from opd.losses.off_policy import OffPolicyCorrection, filtered_sampling_warning
from opd.losses.several_teachers_loss import MixtureLoss, RoutedLoss
from opd.models.interfaces import (
    FullVocabRequest,
    GenerationInterface,
    LossFunction,
    PolicyInterface,
    TeacherInterface,
)
from opd.models.loading import (
    check_output_sizes,
    check_tokenizer_compatibility,
    load_causal_lm,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from opd.policy.hf_policy import HFPolicy
from opd.policy.lora import import_peft
from opd.rollout.hf_generation import HFGeneration
from opd.rollout.multi_turn import Episodes
from opd.rollout.stop_tokens import check_stop_tokens, describe_tokens, stop_token_ids
from opd.run.checkpoint import CheckpointManager
from opd.run.logger import Logger
from opd.run.run_setup import (
    load_examples,
    load_run_tokenizer,
    plan_run_length,
    report_overlap,
    restore_run,
)
from opd.run.training_loop import RunParts, RunSaveState, check_output_is_fresh, find_resume_checkpoint
from opd.run.validation import TeacherEngine
from opd.teachers.backends import model_in_process
from opd.utils.compile_cache import resolve_compile_kernels
from opd.utils.errors import ConfigError
from opd.utils.paths import absolute_model_path

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

log = logging.getLogger("opd")

# Training prompts on which the teacher's probability of the student's stop tokens is probed.
STOP_TOKEN_PROBE_PROMPTS = 8


@dataclass
class DistillationComponents:
    """Everything :func:`~opd.distillation.step.distillation_train` runs with.

    ``teacher_generation`` answers the validation prompts for the baselines (:func:`teacher_engines`; empty without
    them); ``distillation_save_state`` holds the run's counters, fresh or restored.
    """

    student_policy: PolicyInterface
    teacher_policy: TeacherInterface
    student_generation: GenerationInterface
    teacher_generation: list[TeacherEngine]
    dataloader: StatefulDataLoader
    val_dataloader: StatefulDataLoader | None
    tokenizer: Any
    loss_fn: LossFunction
    logger: Logger
    checkpointer: CheckpointManager
    distillation_save_state: RunSaveState
    master_config: MasterConfig

    def run_parts(self) -> RunParts:
        """What the shared training loop trains and where it writes."""
        return RunParts(
            self.student_policy,
            self.tokenizer,
            self.dataloader,
            self.logger,
            self.checkpointer,
            self.distillation_save_state,
            self.master_config,
        )

    def close(self) -> None:
        """Frees what the engines, the teacher and the student hold (a vLLM engine, connections, workers)."""
        for engine in self.teacher_generation:  # before the rollout workers some of them answer on stop
            engine.generation.close()
        self.student_generation.close()
        self.teacher_policy.close()
        self.student_policy.close()


def set_seed(seed: int) -> None:
    """Seeds Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_environment(config: MasterConfig) -> None:
    """Checks what the config needs from this machine, before anything is read or loaded.

    Raises:
        ConfigError: vLLM missing, compilation asked for without a toolchain, an API key unset, or LoRA without peft.
    """
    if config.model.active_lora() is not None:
        import_peft()
    device_type = resolve_device(config.model.device).type
    if isinstance(config.loss_fn, FullVocabKernelSettings):
        resolve_compile_kernels(config.loss_fn.compile_kernels, device_type)
    resolve_compile_kernels(config.generation.compile_decode, device_type, "generation.compile_decode")
    config.generation.engine.check_environment(config.generation)
    config.teacher.teacher_backend.check_environment(config.teacher, "teacher")


def check_config_against_data(config: MasterConfig, train_examples: list[PreparedExample]) -> None:
    """Checks that need the data: λ < 1 needs fixed responses, a task reward (``adv_tau``) ground-truth answers.

    Raises:
        ConfigError: naming the key, the file and how many examples lack what it needs.
    """
    for key, loss in config.teacher_losses():
        if isinstance(loss, (SampledTokenLossConfig, HybridFullVocabLossConfig)) and loss.adv_tau != 0.0:
            missing = sum(example["ground_truth"] is None for example in train_examples)
            if missing:
                raise ConfigError(
                    f"{key}.adv_tau = {loss.adv_tau} rewards correct answers, but {missing} of "
                    f"{len(train_examples)} examples in '{config.data.train_path}' have no ground-truth answer; "
                    f"use data_format math_cl (or set {key}.adv_tau = 0)"
                )
    if config.distillation.lowest_lambda() < 1.0:
        missing = sum(example["response_ids"] is None for example in train_examples)
        if missing:
            raise ConfigError(
                f"distillation.lambda = {config.distillation.lambda_} uses fixed data on some steps, but "
                f"{missing} of {len(train_examples)} examples in '{config.data.train_path}' have no final "
                "assistant message; add responses or set distillation.lambda = 1.0"
            )


def run_tokenizer(config: MasterConfig) -> Any:
    """The tokenizer of the run: ``model.tokenizer_path``, else the student's."""
    return load_run_tokenizer(
        config.model.tokenizer_path or config.model.student_model_path, config.model.trust_remote_code, config.data
    )


def load_models(
    config: MasterConfig, tokenizer: Any, student_path: str
) -> tuple[PreTrainedModel, TeacherInterface | None]:
    """Loads the student from ``student_path`` and builds the one in-process teacher (None if served or several).

    A teacher following the student (``teacher.self_teacher``) is built after it: a live one uses the student's module.

    Raises:
        ModelCompatibilityError: a tokenizer or output layer does not match the run's tokenizer.
        ConfigError: a model whose head the fused loss cannot take.
    """
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    teacher = None
    in_process = not config.teacher.served and config.teachers is None
    loader = RunTeacherLoader(config, tokenizer, student_path, teacher_tokenizer_of(config)) if in_process else None
    if loader is not None and not config.teacher.follows_student:
        teacher = config.teacher.build(loader, resolve_teacher_path(config))
    log.info("loading student %s (%s on %s)", student_path, str(dtype).replace("torch.", ""), device)
    student_model = load_causal_lm(student_path, dtype, device, config.model)
    check_output_sizes(student_model, len(tokenizer), student_path)
    check_fusable(config, student_model, None)
    if loader is not None and config.teacher.follows_student:
        teacher = config.teacher.build_following(loader, student_model)
    return student_model, teacher


def build_generation(config: MasterConfig, model: PreTrainedModel, tokenizer: Any) -> GenerationInterface:
    """The engine ``generation.backend`` names, sampling from (or starting from) ``model``."""
    # An asynchronous schedule samples with the weights of its last sync, not the live ones.
    return config.generation.build(model, tokenizer, config.training.seed, own_copy=config.training.asynchronous)


def build_loss(config: MasterConfig, tokenizer: Any, student_classes: torch.Tensor | None = None) -> LossFunction:
    """The ``loss_fn`` objective, weighing stale samples when ``training.off_policy_correction`` is on.

    ``student_classes`` are what a cross-tokenizer teacher's top-k ids name. Several teachers get a routed or mixture
    loss (:mod:`opd.losses.several_teachers_loss`). The sampled-token loss needs no weights: its clipped ratio is
    already taken against the sampler's log-probs.
    """
    device_type = resolve_device(config.model.device).type
    built: dict[str, LossFunction] = {}  # one objective per key: members without their own share loss_fn's
    warnings: set[str] = set()  # the same strategy for every objective: each said once
    for key, loss in config.teacher_losses():
        if key not in built:
            objective = loss.build(len(tokenizer), device_type)
            if student_classes is not None and isinstance(objective, TopKKLLossFn):
                objective.student_classes = student_classes
            corrected = (DistillationLossFn, FullVocabHybridLossFn)
            if config.training.correction_is_on(loss) and isinstance(objective, corrected):
                objective.off_policy = OffPolicyCorrection.from_config(
                    config.training.off_policy_correction, config.distillation.generate_strategy
                )
                warning = filtered_sampling_warning(objective.off_policy)
                if warning is not None:
                    warnings.add(warning)
            built[key] = objective
    for warning in sorted(warnings):
        log.warning(warning)
    if config.teachers is None:
        return built["loss_fn"]
    names = [member.name for member in config.teachers.members]
    if config.teachers.routes:
        return RoutedLoss([built[key] for key, _ in config.teacher_losses()], names)
    return MixtureLoss(built["loss_fn"], names)


def report_stop_tokens(
    config: MasterConfig,
    tokenizer: Any,
    student_model: PreTrainedModel,
    teacher_model: PreTrainedModel | None,
    train_examples: list[PreparedExample],
) -> tuple[int, ...]:
    """Logs the student's stop ids, checks them against the teacher's (:func:`check_stop_tokens`) and returns them.

    Raises:
        ModelCompatibilityError: the student stops at a token the teacher never emits.
    """
    configured = config.generation.stop_token_ids
    student_stops = tuple(sorted(configured)) if configured is not None else stop_token_ids(tokenizer, student_model)
    log.info("responses end at %s", describe_tokens(tokenizer, student_stops))
    warning = check_stop_tokens(
        tokenizer,
        student_stops,
        None if teacher_model is None else stop_token_ids(tokenizer, teacher_model),
        teacher_model,
        [example["prompt_ids"] for example in train_examples[:STOP_TOKEN_PROBE_PROMPTS]],
    )
    if warning:
        log.warning(warning)
    return student_stops


def build_in_process(
    config: MasterConfig,
    tokenizer: Any,
    total_steps: int,
    micro_batch_size: int,
    resume_from: Path | None,
    train_examples: list[PreparedExample],
    teacher_tokenizer: Any | None = None,
) -> tuple[PolicyInterface, TeacherInterface, GenerationInterface, list[TeacherEngine]]:
    """``(student, teacher, student engine, teacher engines)`` in this process; a resume loads ``policy/``.

    Served or several teachers are built before the student; the one teacher in process with it (:func:`load_models`).
    """
    # Served teachers connect before the student loads: a bad server fails in seconds.
    members = load_teacher_members(config, tokenizer) if config.teachers is not None or config.teacher.served else None
    lora = config.model.active_lora()
    # LoRA resumes from the base model plus the adapter restored with the optimizer (policy/ holds merged weights).
    student_path = (
        str(resume_from / "policy") if resume_from is not None and lora is None else config.model.student_model_path
    )
    student_model, in_process = load_models(config, tokenizer, student_path)
    # A cross-tokenizer teacher has other stop ids.
    teacher_model = model_in_process(in_process) if not config.teacher.cross_tokenizer else None
    report_stop_tokens(config, tokenizer, student_model, teacher_model, train_examples)
    if in_process is not None:
        members = [in_process]
    if members is None:
        raise ConfigError("no teacher: set model.teacher_model_path or teacher.backend = remote")
    teacher = assemble_teacher(config, tokenizer, teacher_tokenizer, members)
    models = _teacher_models_in_process(config, members)
    decode_loop = config.generation.decode_loop
    teacher_generation = teacher_engines(
        config, tokenizer, teacher_tokenizer, lambda name, own: HFGeneration(models[name], own, decode_loop)
    )

    # Before HFPolicy injects LoRA adapters: vLLM's first load wants the plain names (refits send merged weights);
    # the HF engine shares the module, so it samples with the current adapter.
    student_generation = build_generation(config, student_model, tokenizer)
    student_policy = HFPolicy(
        student_model,
        config.training,
        micro_batch_size,
        total_steps,
        config.training.micro_batch_tokens,
        config.training.sequence_packing,
        lora,
        config.training.seed,
    )
    return student_policy, teacher, student_generation, teacher_generation


def build_on_cluster(
    config: MasterConfig, tokenizer: Any, total_steps: int, micro_batch_size: int
) -> tuple[PolicyInterface, TeacherInterface, GenerationInterface, list[TeacherEngine]]:
    """Student, teacher and rollout engines as Ray worker groups (``cluster:``), and the baselines' teacher engines.

    A resume loads the shards afterwards (``restore_run``). The baselines' teachers answer from the rollout workers.
    Colocated teachers are assembled in each trainer worker (:func:`~opd.distillation.teacher_plan.assemble_teacher`);
    the driver holds a facade (:class:`~opd.distributed.colocated_teacher.TeacherInTrainerWorkers`).
    """
    # Served teachers connect before the workers start: a bad server fails in seconds.
    one_served = config.teachers is None and config.teacher.served
    remote_teacher = load_teacher_members(config, tokenizer)[0] if one_served else None
    # Ray is an optional extra the in-process path never needs.
    from opd.distributed.setup import ClusterRequest, build_cluster_backends

    assert config.cluster is not None
    teacher_paths = _cluster_teacher_paths(config)
    same_tokenizer = not config.teacher.cross_tokenizer  # a cross-tokenizer teacher was checked as such
    for path in teacher_paths.values() if same_tokenizer else ():  # before any worker loads a model
        teacher_tokenizer = load_tokenizer(path, config.model.trust_remote_code)
        check_tokenizer_compatibility(tokenizer, teacher_tokenizer, config.model.student_model_path, path)
    served = {  # several teachers' served members
        member.name: connect_remote_teacher(config, tokenizer, member.remote, member.model_path)
        for member in (config.teachers.members if config.teachers is not None else ())
        if member.served
    }
    request = ClusterRequest(
        student_path=config.model.student_model_path,
        teacher_paths=teacher_paths,
        loading=config.model,
        optimizer=config.training,
        total_steps=total_steps,
        micro_batch_size=micro_batch_size,
        micro_batch_tokens=config.training.micro_batch_tokens,
        sequence_packing=config.training.sequence_packing,
        tokenizer=tokenizer,
        generation=config.generation,
        seed=config.training.seed,
        checkpoint_dir=config.checkpointing.checkpoint_dir if config.checkpointing.enabled else None,
        lora=config.model.active_lora(),
        teacher_assembly=functools.partial(assemble_in_worker, config, tokenizer, teacher_tokenizer_of(config)),
        teacher_head_paths=_teacher_head_paths(config),
        share_prompt_forward=_cluster_prompt_sharing(config, teacher_paths),
    )
    policy, on_cluster, generation = build_cluster_backends(config.cluster, request)
    try:
        baselines = _baseline_engines_on_cluster(config, tokenizer, generation, teacher_paths)
        if teacher_paths and not config.cluster.teacher.in_pool:  # assembled in the workers, asked through this facade
            return policy, on_cluster[0], generation, baselines
        if config.teachers is None:
            members = [remote_teacher if remote_teacher is not None else on_cluster[0]]
        else:
            local = [member.name for member in config.teachers.members if not member.served]
            pools = dict(zip(local, on_cluster, strict=True))  # in the order of teacher_paths
            members = load_teacher_members(config, tokenizer, ready={**served, **pools})
        teacher = assemble_teacher(config, tokenizer, teacher_tokenizer_of(config), members)
    except BaseException:
        policy.close()  # stops the workers
        raise
    return policy, teacher, generation, baselines


def _baseline_engines_on_cluster(
    config: MasterConfig, tokenizer: Any, generation: GenerationInterface, teacher_paths: dict[str, str]
) -> list[TeacherEngine]:
    """The baselines' teacher engines on a cluster: the rollout workers answer for each local teacher of the run
    (``teacher_paths``: :func:`_cluster_teacher_paths`)."""
    from opd.distributed.rollout import RayGeneration, TeacherOnRolloutWorkers

    assert isinstance(generation, RayGeneration)

    def on_rollout_workers(name: str | None, own_tokenizer: Any) -> GenerationInterface:
        key = "teacher" if name is None else f"teacher {name}"
        return TeacherOnRolloutWorkers(generation, key, absolute_model_path(teacher_paths[key]), own_tokenizer)

    return teacher_engines(config, tokenizer, teacher_tokenizer_of(config), on_rollout_workers)


def _teacher_head_paths(config: MasterConfig) -> tuple[str | None, ...]:
    """The models whose output layers the trainer workers load, by teacher position (empty: none).

    A teacher apart (pool or served) answers a full-vocabulary objective with hidden states alone, which each worker
    binds to its own copy of the head; with several teachers, each such member has its own.
    """
    assert config.cluster is not None
    in_pool = config.cluster.teacher.in_pool
    if config.teachers is None:
        apart = config.teacher.served or in_pool
        if apart and isinstance(config.loss_fn.teacher_request(None), FullVocabRequest):
            return (resolve_teacher_path(config),)
        return ()
    heads: list[str | None] = []
    for member, (_, loss) in zip(config.teachers.members, config.teacher_losses(), strict=True):
        full_vocab = isinstance(loss.teacher_request(None), FullVocabRequest)
        apart = member.served or in_pool
        heads.append(member_teacher_path(config, member) if full_vocab and apart else None)
    return tuple(heads) if any(head is not None for head in heads) else ()


def _cluster_teacher_paths(config: MasterConfig) -> dict[str, str]:
    """The teachers the cluster runs, by worker role: the one teacher, or each local member of ``teachers:``."""
    if config.teachers is not None:
        return {
            f"teacher {member.name}": member_teacher_path(config, member)
            for member in config.teachers.members
            if not member.served
        }
    return {} if config.teacher.served else {"teacher": resolve_teacher_path(config)}


def _cluster_prompt_sharing(config: MasterConfig, teacher_paths: dict[str, str]) -> tuple[bool, ...]:
    """Each cluster teacher's ``share_prompt_forward``, in the order of ``teacher_paths``."""
    if config.teachers is None:
        return tuple(config.teacher.share_prompt_forward for _ in teacher_paths)
    by_role = {f"teacher {member.name}": member.share_prompt_forward for member in config.teachers.members}
    return tuple(by_role[role] for role in teacher_paths)


def setup(master_config: MasterConfig) -> DistillationComponents:
    """Builds everything ``distillation_train`` needs, checking user input first; resumes from the newest checkpoint.

    Raises:
        ConfigError: a config the machine or the data cannot serve.
        DataError: a malformed data file (naming the file and line).
        ModelCompatibilityError: teacher and student that do not share a tokenizer.
    """
    config = master_config
    micro_batch_size, _ = resolve_micro_batching(config)
    check_environment(config)
    for line in plan_teacher(config).lines():
        log.info(line)
    checkpointer = CheckpointManager(config.checkpointing)
    check_output_is_fresh(config.output_dir, checkpointer)
    set_seed(config.training.seed)

    tokenizer = run_tokenizer(config)
    context = config.distillation.teacher_context_spec()
    choice = config.teachers.choice() if config.teachers is not None else None
    teacher_tokenizer = teacher_tokenizer_of(config)
    # Multi-turn rollouts: every training and validation prompt lists the environment's tools and keeps its messages.
    episodes = Episodes.from_config(config.environment)
    tools = episodes.tools_of if episodes is not None else None
    examples_of = functools.partial(
        load_examples, config.data, tokenizer, teacher_context=context, teacher_choice=choice,
        teacher_tokenizer=teacher_tokenizer, tools=tools,
    )  # fmt: skip
    train_examples = examples_of(split="train")
    check_config_against_data(config, train_examples)
    training = config.training
    steps_per_epoch, total_steps = plan_run_length(
        len(train_examples), training.batch_size, training.num_epochs, training.max_num_steps, config.data.train_path
    )
    val_examples = examples_of(split="val") if config.data.has_validation else None  # episodes too
    report_overlap(train_examples, val_examples, config.data)

    resume_from = find_resume_checkpoint(config.checkpointing.enabled, checkpointer)
    if config.cluster is not None:
        built = build_on_cluster(config, tokenizer, total_steps, micro_batch_size)
    else:
        built = build_in_process(
            config, tokenizer, total_steps, micro_batch_size, resume_from, train_examples, teacher_tokenizer
        )
    student_policy, teacher, student_generation, teacher_generation = built
    save_state = restore_run(resume_from, student_policy, checkpointer, config, total_steps)
    logger = Logger(config.logger, total_steps)
    logger.log_hyperparams(config.model_dump(mode="json", by_alias=True))
    log.info(
        "%d train prompts, %s val prompts, %d steps (%d per epoch), %d sequences per step in micro-batches of %d",
        len(train_examples),
        len(val_examples) if val_examples else 0,
        total_steps,
        steps_per_epoch,
        training.batch_size * config.distillation.num_samples_per_prompt,
        micro_batch_size,
    )
    return DistillationComponents(
        student_policy=student_policy,
        teacher_policy=teacher,
        student_generation=student_generation,
        teacher_generation=teacher_generation,
        dataloader=make_train_dataloader(train_examples, training.batch_size, config.data.shuffle, training.seed),
        val_dataloader=make_eval_dataloader(val_examples, config.validation.batch_size) if val_examples else None,
        tokenizer=tokenizer,
        loss_fn=build_loss(config, tokenizer, teacher.student_classes),
        logger=logger,
        checkpointer=checkpointer,
        distillation_save_state=save_state,
        master_config=config,
    )
