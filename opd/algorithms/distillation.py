"""On-policy knowledge distillation: configs, ``setup()``, ``distillation_train()``, ``evaluate()``.

One optimizer step (see ``docs/guides/on-policy-distillation.md``):

1. take ``batch_size`` prompts from the resumable dataloader;
2. flip the λ coin (a dedicated, seeded RNG): with probability ``lambda`` the step is
   on-policy and the student samples ``num_samples_per_prompt`` responses per prompt;
   otherwise the step uses fixed data (the dataset's assistant turn);
3. the frozen teacher scores the very same token ids, micro-batch by micro-batch;
4. the student minimises the token-level KL on response tokens, normalised over the
   whole global batch, with gradient accumulation over micro-batches and one AdamW step;
5. metrics are logged; validation runs every ``val_freq`` steps and checkpoints are
   written every ``save_freq`` steps.

The driver only talks to the interfaces in :mod:`opd.models.interfaces`, as NeMo-RL's
``grpo_train`` does, so other generation engines and teachers plug in unchanged. What
happens around a step (resume, validation, checkpoints, stop) is shared with SFT in
:mod:`opd.algorithms.training_loop`; ``validate`` lives in :mod:`opd.algorithms.validation`
and is importable from here too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import resource
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torchdata.stateful_dataloader import StatefulDataLoader

from opd.algorithms.interfaces import LossFunction
from opd.algorithms.compiled_kernels import resolve_compile_kernels
from opd.algorithms.hybrid_loss import FullVocabHybridLossFn
from opd.algorithms.fused_lm_head import output_head_of
from opd.algorithms.loss_functions import DistillationLossFn, SampledTokenLossFn
from opd.algorithms.training_loop import (
    RunSaveState,
    TrainingLoopConfig,
    check_output_is_fresh,
    find_resume_checkpoint,
    fresh_save_state,
    run_training_loop,
    warn_on_config_change,
)
from opd.algorithms.validation import ValidationConfig, validate
from opd.data.batched_data_dict import BatchedDataDict
from opd.data.config import DataConfig
from opd.data.dataloaders import PreparedExample, make_eval_dataloader, make_train_dataloader, prepare_examples
from opd.data.datasets import load_chat_dataset
from opd.data.sequences import build_token_mask, pack_sequences
from opd.data.teacher_context import TeacherContext
from opd.environments.math_verifier import is_correct
from opd.models.config import ModelConfig, TeacherConfig
from opd.models.generation.config import GenerateStrategyConfig, GenerationConfig
from opd.models.generation.hf_generation import HFGeneration
from opd.models.interfaces import GenerationInterface, PolicyInterface, TeacherInterface
from opd.models.loading import (
    check_output_sizes,
    check_tokenizer_compatibility,
    load_causal_lm,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from opd.models.policy.hf_policy import HFPolicy
from opd.models.teacher.context_teacher import ContextTeacher
from opd.models.teacher.local_teacher import LocalTeacher
from opd.models.teacher.remote_teacher import RemoteTeacher
from opd.utils.checkpoint import CheckpointingConfig, CheckpointManager
from opd.utils.config import StrictConfig
from opd.utils.errors import ConfigError
from opd.utils.logger import Logger, LoggerConfig

log = logging.getLogger("opd")


# --------------------------------------------------------------------------- configs


class DistillationConfig(StrictConfig):
    """The distillation strategy (the specification's §4.2 keys)."""

    lambda_: float = Field(
        1.0, alias="lambda", ge=0.0, le=1.0, description="probability that a step uses the student's own samples"
    )
    kl_type: Literal["forward", "reverse", "mixed"] = "reverse"
    mixed_kl_weight: float = Field(0.5, ge=0.0, le=1.0, description="weight of forward KL when kl_type=mixed")
    kl_temperature: float = Field(1.0, gt=0.0, description="softmax temperature of both models inside the KL")
    kl_reduction: Literal["mean", "sum"] = "mean"
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

    def teacher_context_spec(self) -> TeacherContext | None:
        """The teacher-only context these keys describe, or None without one."""
        if self.teacher_context is None and self.teacher_context_key is None:
            return None
        return TeacherContext(self.teacher_context, self.teacher_context_key, self.teacher_context_placement,
                              self.teacher_context_separator)


class LossFnConfig(StrictConfig):
    """What the student matches and how the loss is computed (``loss_fn:`` in the YAML).

    ``distillation.kl_type`` / ``mixed_kl_weight`` / ``kl_temperature`` / ``kl_reduction``
    (the specification's keys) keep their meaning; this section chooses the teacher
    signal, the divergence family and the memory-lean fused computation.
    """

    type: Literal["full_vocab", "topk", "sampled_token", "hybrid_full_vocab"] = Field(
        "full_vocab",
        description="full_vocab: exact divergence over the whole vocabulary; topk: the teacher sends its top "
        "teacher_topk log-probs per position; sampled_token: reverse KL on the sampled token as a policy gradient; "
        "hybrid_full_vocab: the tau-weighted reverse KL over the vocabulary plus adv_tau x task-reward policy gradient",
    )
    divergence: Literal["kl", "jsd"] = Field("kl", description="kl (distillation.kl_type) or generalized jsd (jsd_beta)")
    jsd_beta: float = Field(0.5, ge=0.0, le=1.0, description="JSD interpolation: 0 = forward KL, 1 = reverse KL")
    teacher_topk: int = Field(64, ge=1, description="k of the top-k teacher signal and of the top-k metrics")
    topk_tail: bool = Field(True, description="top-k keeps a 'rest' class (a true divergence); false renormalises")
    fused_lm_head: bool = Field(True, description="compute logits and loss chunk by chunk from hidden states")
    chunk_size: int | None = Field(None, ge=1, description="positions per fused chunk; null: ~128 MiB of logits")
    compile_kernels: bool | Literal["auto"] = Field(
        "auto", description="torch.compile the full-vocabulary loss kernels; auto: where a compiler toolchain exists"
    )
    teacher_tau: float = Field(1.0, description="sampled_token / hybrid_full_vocab: weight of the teacher's log-prob")
    student_tau: float = Field(1.0, description="sampled_token / hybrid_full_vocab: weight of the student's log-prob")
    discount: float = Field(0.0, ge=0.0, le=1.0, description="sampled_token: discount over future tokens' advantages")
    adv_tau: float = Field(
        0.0, description="sampled_token / hybrid_full_vocab: weight of the task reward (the math verifier)"
    )
    clip_ratio: float | None = Field(0.2, gt=0.0, description="sampled_token: importance-ratio clip; null: none")


class TrainingConfig(TrainingLoopConfig):
    """Loop, batch and optimizer settings (the specification's §4.3 keys)."""

    batch_size: int = Field(8, ge=1, description="prompts per optimizer step")
    micro_batch_size: int | None = Field(None, ge=1, description="sequences per forward/backward pass")
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="padded-token budget per forward/backward pass (length-sorted dynamic batching)"
    )
    sequence_packing: bool = Field(False, description="pack each micro-batch into one padding-free row")
    gradient_accumulation_steps: int | None = Field(None, ge=1, description="micro-batches per optimizer step")


class DistillationValidationConfig(ValidationConfig):
    """Validation settings of a distillation run (adds the teacher baseline and ``opd eval``'s model)."""

    teacher_baseline: bool = Field(False, description="once, before training: the teacher answers the val prompts")
    eval_baseline: bool = Field(
        False, description="once, before training: student without and teacher with the teacher-only context "
                           "answer the val prompts (val/baseline_*)"
    )
    model_path: str | None = Field(
        None, description="model evaluated by `opd eval` / val_only: a model dir or step_N checkpoint"
    )


class MasterConfig(StrictConfig):
    """The whole run's configuration (one YAML file)."""

    output_dir: str = Field("results/distillation", description="final model, logs and checkpoints go here")
    val_only: bool = Field(False, description="run validation on validation.model_path (or the student) and exit")
    model: ModelConfig
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    distillation: DistillationConfig = Field(default_factory=DistillationConfig)
    loss_fn: LossFnConfig = Field(default_factory=LossFnConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    data: DataConfig
    validation: DistillationValidationConfig = Field(default_factory=DistillationValidationConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)


def resolve_micro_batching(config: MasterConfig) -> tuple[int, int]:
    """Returns ``(micro_batch_size, gradient_accumulation_steps)`` from the config.

    On-policy steps train ``batch_size × num_samples_per_prompt`` sequences. As in
    DeepSpeed, either knob may be given and the other is derived; if both are given they
    must multiply to that number.

    Raises:
        ConfigError: if the two knobs disagree or do not divide the batch.
    """
    training = config.training
    sequences = training.batch_size * config.distillation.num_samples_per_prompt
    micro, accumulation = training.micro_batch_size, training.gradient_accumulation_steps
    if training.micro_batch_tokens is not None and (micro is not None or accumulation is not None):
        raise ConfigError(
            "training.micro_batch_tokens forms micro-batches by a token budget; set training.micro_batch_size "
            "and training.gradient_accumulation_steps to null when you use it"
        )
    if micro is None and accumulation is None:
        return sequences, 1
    if micro is None:
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


# --------------------------------------------------------------------------- state


DistillationSaveState = RunSaveState
"""Counters saved in every checkpoint (see :class:`~opd.algorithms.training_loop.RunSaveState`)."""


# --------------------------------------------------------------------------- setup


def set_seed(seed: int) -> None:
    """Seeds Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_loss_config(config: MasterConfig) -> None:
    """Cross-checks between ``loss_fn`` and ``distillation`` that pydantic cannot express.

    Raises:
        ConfigError: naming the keys that conflict.
    """
    loss = config.loss_fn
    # `true` without a compiler toolchain stops here, before any model is loaded.
    resolve_compile_kernels(loss.compile_kernels, resolve_device(config.model.device).type)
    if loss.type == "sampled_token":
        if config.distillation.lambda_ < 1.0:
            raise ConfigError(
                f"loss_fn.type = sampled_token needs the student's own samples on every step, but "
                f"distillation.lambda = {config.distillation.lambda_}; set distillation.lambda = 1.0"
            )
        if config.distillation.kl_temperature != 1.0:
            raise ConfigError(
                "loss_fn.type = sampled_token scores the tokens under the sampler's own distribution; set "
                "distillation.kl_temperature = 1.0 and choose the sampling temperature in generate_strategy"
            )
    if loss.type == "hybrid_full_vocab":
        if loss.adv_tau != 0.0 and config.distillation.lambda_ < 1.0:
            raise ConfigError(
                f"loss_fn.adv_tau = {loss.adv_tau} rewards the student's own answers, which only on-policy steps "
                f"have, but distillation.lambda = {config.distillation.lambda_}; set distillation.lambda = 1.0"
            )
        if config.distillation.kl_temperature != 1.0:
            raise ConfigError("loss_fn.type = hybrid_full_vocab works at temperature 1; set "
                              "distillation.kl_temperature = 1.0")
    if loss.type == "topk" and loss.divergence == "jsd":
        raise ConfigError("loss_fn.divergence = jsd needs the teacher's full vocabulary; use loss_fn.type = full_vocab")


def check_generation_config(config: MasterConfig) -> None:
    """What ``generation.backend`` needs (checked before any model loads).

    Raises:
        ConfigError: if ``vllm`` is asked for and cannot be imported, or if vLLM's
            ``max_model_len`` leaves no room for ``generate_strategy.max_length``.
    """
    if config.generation.backend != "vllm":
        return
    from opd.models.generation.vllm_generation import import_vllm

    import_vllm()
    max_model_len = config.generation.vllm.max_model_len
    max_length = config.distillation.generate_strategy.max_length
    if max_model_len is not None and max_model_len <= max_length:
        raise ConfigError(
            f"generation.vllm.max_model_len = {max_model_len} leaves no room for a prompt before "
            f"distillation.generate_strategy.max_length = {max_length} new tokens"
        )


def check_teacher_config(config: MasterConfig) -> None:
    """What a local or served teacher needs from the rest of the config (checked before any model loads).

    Raises:
        ConfigError: naming the keys that conflict.
    """
    teacher = config.teacher
    distillation = config.distillation
    if distillation.teacher_context_spec() is not None and not distillation.mask_prompt_tokens:
        raise ConfigError("distillation.teacher_context: the teacher's prompt differs from the student's, so only "
                          "completion tokens can be scored; set distillation.mask_prompt_tokens = true")
    if config.validation.eval_baseline and distillation.teacher_context_spec() is None:
        raise ConfigError("validation.eval_baseline compares the student without and the teacher with the "
                          "teacher-only context; set distillation.teacher_context or teacher_context_key")
    if teacher.backend == "local":
        if config.model.teacher_model_path is None:
            raise ConfigError("model.teacher_model_path is required with teacher.backend = local "
                              "('student' = a frozen copy of the student's initial weights)")
        return
    if config.validation.eval_baseline:
        raise ConfigError("validation.eval_baseline generates with the teacher model in process; "
                          "set it to false with teacher.backend = remote")
    if teacher.remote.url is None:
        raise ConfigError("teacher.backend = remote needs teacher.remote.url (e.g. http://127.0.0.1:8000)")
    if config.loss_fn.type in ("full_vocab", "hybrid_full_vocab"):
        raise ConfigError("teacher.backend = remote sends top-k log-probs, not full-vocabulary logits; "
                          "set loss_fn.type = topk or sampled_token")
    if config.loss_fn.type == "topk" and config.distillation.kl_temperature != 1.0:
        raise ConfigError(f"teacher.backend = remote answers at temperature 1, but distillation.kl_temperature = "
                          f"{config.distillation.kl_temperature}; set it to 1.0")
    if config.validation.teacher_baseline:
        raise ConfigError("validation.teacher_baseline generates with the teacher model in process; "
                          "set it to false with teacher.backend = remote")
    if teacher.remote.api_key_env and not os.environ.get(teacher.remote.api_key_env):
        raise ConfigError(f"teacher.remote.api_key_env names the environment variable "
                          f"{teacher.remote.api_key_env}, which is unset or empty")


def wrap_teacher(teacher: Any, config: MasterConfig, tokenizer: Any) -> Any:
    """With a teacher-only context, a teacher that scores each completion under its own prompt."""
    if config.distillation.teacher_context_spec() is None:
        return teacher
    return ContextTeacher(teacher, tokenizer.pad_token_id)


def connect_remote_teacher(config: MasterConfig, tokenizer: Any) -> RemoteTeacher:
    """The client of the served teacher, after checking that it answers and tokenizes like ``tokenizer``."""
    remote = config.teacher.remote
    assert remote.url is not None  # check_teacher_config
    client = RemoteTeacher(
        remote.url, remote.model, os.environ.get(remote.api_key_env) if remote.api_key_env else None,
        remote.max_concurrency, remote.sequences_per_request, remote.timeout_s, remote.max_retries, remote.backoff_s,
    )
    client.connect(tokenizer)
    log.info("teacher: %s served at %s", client.model, remote.url)
    return client


def make_loss_fn(
    config: MasterConfig, vocab_size: int
) -> DistillationLossFn | SampledTokenLossFn | FullVocabHybridLossFn:
    """The loss object described by ``distillation`` and ``loss_fn``."""
    loss, distillation = config.loss_fn, config.distillation
    if loss.type == "hybrid_full_vocab":
        return FullVocabHybridLossFn(teacher_tau=loss.teacher_tau, student_tau=loss.student_tau, adv_tau=loss.adv_tau,
                                     kl_reduction=distillation.kl_reduction, vocab_size=vocab_size)
    if loss.type == "sampled_token":
        return SampledTokenLossFn(
            teacher_tau=loss.teacher_tau, student_tau=loss.student_tau, discount=loss.discount,
            adv_tau=loss.adv_tau, clip_ratio=loss.clip_ratio, kl_reduction=distillation.kl_reduction,
            fused_lm_head=loss.fused_lm_head, chunk_size=loss.chunk_size, vocab_size=vocab_size,
        )
    return DistillationLossFn(
        kl_type=distillation.kl_type,
        mixed_kl_weight=distillation.mixed_kl_weight,
        temperature=distillation.kl_temperature,
        kl_reduction=distillation.kl_reduction,
        vocab_size=vocab_size,
        divergence=loss.divergence,
        jsd_beta=loss.jsd_beta,
        teacher_signal=loss.type,
        teacher_topk=loss.teacher_topk,
        topk_tail=loss.topk_tail,
        fused_lm_head=loss.fused_lm_head,
        chunk_size=loss.chunk_size,
        compile_kernels=resolve_compile_kernels(loss.compile_kernels, resolve_device(config.model.device).type),
    )


def check_config_against_data(config: MasterConfig, train_examples: list[PreparedExample]) -> None:
    """Cross-checks that need the data: λ < 1 needs fixed responses to train on, a task
    reward needs ground-truth answers."""
    if config.loss_fn.type in ("sampled_token", "hybrid_full_vocab") and config.loss_fn.adv_tau != 0.0:
        missing = sum(example["ground_truth"] is None for example in train_examples)
        if missing:
            raise ConfigError(
                f"loss_fn.adv_tau = {config.loss_fn.adv_tau} rewards correct answers, but {missing} of "
                f"{len(train_examples)} examples in '{config.data.train_path}' have no ground-truth answer; "
                "use data_format math_cl (or set loss_fn.adv_tau = 0)"
            )
    if config.distillation.lambda_ < 1.0:
        missing = sum(example["response_ids"] is None for example in train_examples)
        if missing:
            raise ConfigError(
                f"distillation.lambda = {config.distillation.lambda_} uses fixed data on some steps, but "
                f"{missing} of {len(train_examples)} examples in '{config.data.train_path}' have no final "
                "assistant message; add responses or set distillation.lambda = 1.0"
            )


def _load_tokenizer(config: MasterConfig) -> Any:
    tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.student_model_path, config.model.trust_remote_code)
    if config.data.chat_template:
        tokenizer.chat_template = config.data.chat_template
    return tokenizer


def _load_examples(config: MasterConfig, tokenizer: Any, path: str, split: str, max_examples: int | None) -> list[PreparedExample]:
    raw = load_chat_dataset(
        path, split=split, max_examples=max_examples, data_format=config.data.data_format, prompt_file=config.data.prompt_file
    )
    return prepare_examples(raw, tokenizer, config.data.max_prompt_length, path,
                            config.distillation.teacher_context_spec())


SELF_DISTILLATION_TEACHER = "student"
"""``model.teacher_model_path: student``: the teacher is a frozen copy of the student's initial weights."""


def resolve_teacher_path(config: MasterConfig) -> str:
    """The in-process teacher's model path; ``student`` means the student's starting point.

    For self-distillation the teacher is ``model.student_model_path`` as given, never the
    checkpoint a run resumes from: the teacher stays the initial student for the whole run
    (a second copy of the weights in memory, without gradients or optimizer state).
    """
    path = config.model.teacher_model_path
    assert path is not None  # check_teacher_config
    return config.model.student_model_path if path == SELF_DISTILLATION_TEACHER else path


def _load_models(
    config: MasterConfig, tokenizer: Any, student_path: str
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """Loads student (from ``student_path``) and frozen teacher, after the tokenizer check.

    A served teacher (``teacher.backend: remote``) is not loaded: the teacher is None.
    """
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    if config.teacher.backend == "remote":
        log.info("loading student %s (%s on %s)", student_path, str(dtype).replace("torch.", ""), device)
        student_model = load_causal_lm(student_path, dtype, device, config.model)
        check_output_sizes(student_model, len(tokenizer), student_path)
        return student_model, None
    teacher_path = resolve_teacher_path(config)
    # The teacher's own tokenizer is checked even when model.tokenizer_path overrides the
    # student's: the teacher's logits are indexed by the ids its tokenizer defines.
    teacher_tokenizer = load_tokenizer(teacher_path, config.model.trust_remote_code)
    check_tokenizer_compatibility(tokenizer, teacher_tokenizer, student_path, teacher_path)
    log.info("loading student %s and teacher %s (%s on %s)", student_path,
             teacher_path, str(dtype).replace("torch.", ""), device)
    student_model = load_causal_lm(student_path, dtype, device, config.model)
    teacher_model = load_causal_lm(teacher_path, dtype, device, config.model)
    for model, name in ((student_model, student_path), (teacher_model, teacher_path)):
        check_output_sizes(model, len(tokenizer), name)
    return student_model, teacher_model


def build_student_generation(config: MasterConfig, student_model: torch.nn.Module, tokenizer: Any) -> GenerationInterface:
    """The engine ``generation.backend`` names, sampling from (or starting from) ``student_model``."""
    if config.generation.backend == "vllm":
        # Imported here: vLLM is optional and slow to import.
        from opd.models.generation.vllm_generation import VllmGeneration

        return VllmGeneration(student_model, tokenizer, config.generation.vllm, config.training.seed)
    return HFGeneration(
        student_model, tokenizer, config.generation.decode_loop,
        resolve_compile_kernels(config.generation.compile_decode, student_model.device.type, "generation.compile_decode"),
    )


def close_generation(generation: Any) -> None:
    """Shuts down an engine that holds resources of its own (vLLM); a no-op for the HF backend."""
    close = getattr(generation, "close", None)
    if callable(close):
        close()


def setup(master_config: MasterConfig) -> tuple:
    """Builds everything ``distillation_train`` needs, checking user input first.

    Order matters: data files are read and validated before any model is loaded, so a
    malformed line fails in seconds, not after loading a 32B teacher. If the checkpoint
    directory holds a complete checkpoint, the run resumes from the newest one: the
    student's weights, optimizer, schedule and counters are restored here, the RNG
    streams and data position by ``distillation_train``.

    Returns:
        ``(student_policy, teacher_policy, student_generation, dataloader,
        val_dataloader, tokenizer, loss_fn, logger, checkpointer,
        distillation_save_state, master_config)``.
    """
    config = master_config
    micro_batch_size, _ = resolve_micro_batching(config)
    check_loss_config(config)
    check_teacher_config(config)
    check_generation_config(config)
    # generation.compile_decode: true without a compiler toolchain stops here too.
    resolve_compile_kernels(config.generation.compile_decode, resolve_device(config.model.device).type,
                            "generation.compile_decode")
    checkpointer = CheckpointManager(config.checkpointing)
    check_output_is_fresh(config.output_dir, checkpointer)
    set_seed(config.training.seed)

    tokenizer = _load_tokenizer(config)
    train_examples = _load_examples(
        config, tokenizer, config.data.train_path, config.data.train_split, config.data.max_train_examples
    )
    check_config_against_data(config, train_examples)
    if len(train_examples) < config.training.batch_size:
        raise ConfigError(
            f"training.batch_size = {config.training.batch_size} exceeds the {len(train_examples)} "
            f"usable examples in '{config.data.train_path}'"
        )
    val_examples = (
        _load_examples(config, tokenizer, config.data.val_path, config.data.val_split, config.data.max_val_examples)
        if config.data.val_path
        else None
    )

    resume_from = find_resume_checkpoint(config.checkpointing.enabled, checkpointer)
    student_path = str(resume_from / "policy") if resume_from else config.model.student_model_path
    # A served teacher is checked before the student loads: an unreachable or mismatched
    # server fails in seconds.
    remote_teacher = connect_remote_teacher(config, tokenizer) if config.teacher.backend == "remote" else None
    student_model, teacher_model = _load_models(config, tokenizer, student_path)
    teacher_policy = wrap_teacher(remote_teacher or LocalTeacher(teacher_model), config, tokenizer)

    steps_per_epoch = len(train_examples) // config.training.batch_size
    total_steps = steps_per_epoch * config.training.num_epochs
    if config.training.max_num_steps is not None:
        total_steps = min(total_steps, config.training.max_num_steps)

    student_policy = HFPolicy(
        student_model, config.training, micro_batch_size, total_steps, config.training.micro_batch_tokens,
        config.training.sequence_packing,
    )
    student_generation = build_student_generation(config, student_model, tokenizer)
    dataloader = make_train_dataloader(
        train_examples, config.training.batch_size, config.data.shuffle, config.training.seed
    )
    val_dataloader = make_eval_dataloader(val_examples, config.validation.batch_size) if val_examples else None
    loss_fn = make_loss_fn(config, len(tokenizer))
    if config.loss_fn.fused_lm_head:
        # Fail before training if a model's head cannot be fused (soft-capped logits, ...).
        for model, name in ((student_model, "the student"), (teacher_model, "the teacher")):
            if model is None:  # a served teacher applies its own head
                continue
            try:
                output_head_of(model, name)
            except ValueError as error:
                raise ConfigError(str(error)) from None
    save_state = fresh_save_state()
    if resume_from is not None:
        warn_on_config_change(resume_from, config)
        student_policy.load_state_dict(checkpointer.load_optimizer_state(resume_from))
        save_state.update(checkpointer.load_save_state(resume_from))  # type: ignore[typeddict-item]
        checkpointer.protected_step = save_state["best_step"]
        log.info("resuming from %s (step %d of %d)", resume_from, save_state["step"], total_steps)
    logger = Logger(config.logger, total_steps)
    logger.log_hyperparams(config.model_dump(mode="json", by_alias=True))
    log.info(
        "%d train prompts, %s val prompts, %d steps (%d per epoch), %d sequences per step in micro-batches of %d",
        len(train_examples), len(val_examples) if val_examples else 0, total_steps, steps_per_epoch,
        config.training.batch_size * config.distillation.num_samples_per_prompt, micro_batch_size,
    )
    return (
        student_policy, teacher_policy, student_generation, dataloader, val_dataloader,
        tokenizer, loss_fn, logger, checkpointer, save_state, master_config,
    )


# --------------------------------------------------------------------------- one step


def build_fixed_data_batch(examples: list[PreparedExample], pad_token_id: int, mask_prompt_tokens: bool) -> BatchedDataDict:
    """The off-policy branch: prompt + the dataset's assistant turn, one row per prompt."""
    sequences = [example["prompt_ids"] + example["response_ids"] for example in examples]  # type: ignore[operator]
    batch = pack_sequences(
        sequences, [len(example["prompt_ids"]) for example in examples], pad_token_id, mask_prompt_tokens
    )
    batch["response_lengths"] = batch["input_lengths"] - batch["prompt_lengths"]
    batch["truncated"] = torch.zeros(batch.size, dtype=torch.bool)
    attach_teacher_prompts(batch, examples, 1)
    return batch


def attach_teacher_prompts(batch: BatchedDataDict, examples: list[PreparedExample], num_samples: int) -> None:
    """Context distillation: gives each row its example's teacher prompt (samples of one prompt are adjacent)."""
    if examples and "teacher_prompt_ids" in examples[0]:
        batch["teacher_prompt_ids"] = [examples[row // num_samples]["teacher_prompt_ids"] for row in range(batch.size)]


def build_on_policy_batch(
    examples: list[PreparedExample],
    student_generation: GenerationInterface,
    config: MasterConfig,
) -> BatchedDataDict:
    """The on-policy branch: the student samples responses to the prompts."""
    student_generation.prepare_for_generation()
    try:
        batch = student_generation.generate(
            [example["prompt_ids"] for example in examples],
            config.distillation.generate_strategy,
            config.distillation.num_samples_per_prompt,
            # Only the sampled-token loss reads the sampler's log-probs; computing them
            # costs a log-softmax over the vocabulary at every decoding step.
            return_logprobs=config.loss_fn.type == "sampled_token",
        )
    finally:
        student_generation.finish_generation()
    batch["token_mask"] = build_token_mask(
        batch["input_lengths"], batch["prompt_lengths"], batch["input_ids"].shape[1],
        config.distillation.mask_prompt_tokens,
    )
    attach_teacher_prompts(batch, examples, config.distillation.num_samples_per_prompt)
    return batch


def task_rewards(batch: BatchedDataDict, examples: list[PreparedExample], num_samples: int, tokenizer: Any) -> torch.Tensor:
    """``[N]`` task reward of each sampled response: 1.0 if the math verifier accepts it."""
    rewards = torch.zeros(batch.size, dtype=torch.float32)
    for row in range(batch.size):
        example = examples[row // num_samples]  # samples of one prompt are adjacent
        start, end = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
        response = tokenizer.decode(batch["input_ids"][row, start:end], skip_special_tokens=True)
        rewards[row] = float(is_correct(response, example["ground_truth"]))
    return rewards


def _peak_memory_mb() -> float:
    """Peak resident memory of this process (CPU) or peak allocated GPU memory, in MiB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def evaluate(master_config: MasterConfig) -> dict[str, float]:
    """``opd eval`` / ``val_only``: validates one model against the teacher and returns metrics.

    The model is ``validation.model_path`` (an HF model directory or a ``step_N``
    checkpoint), else the newest checkpoint of the run, else ``model.student_model_path``.
    Metrics are also written to ``<log_dir>/eval_metrics.json``.

    Raises:
        ConfigError: if there is no validation data or the model cannot be found.
    """
    config = master_config
    if not config.data.val_path:
        raise ConfigError("evaluation needs validation data: set data.val_path")
    check_teacher_config(config)
    check_generation_config(config)
    set_seed(config.training.seed)
    tokenizer = _load_tokenizer(config)
    examples = _load_examples(config, tokenizer, config.data.val_path, config.data.val_split, config.data.max_val_examples)
    model_path = config.validation.model_path
    if model_path is None:
        latest = CheckpointManager(config.checkpointing).latest_checkpoint()
        model_path = str(latest) if latest else config.model.student_model_path
    if (Path(model_path) / "policy" / "config.json").is_file():  # a step_N checkpoint
        model_path = str(Path(model_path) / "policy")
    student_model, teacher_model = _load_models(config, tokenizer, model_path)
    student_model.eval()
    teacher = connect_remote_teacher(config, tokenizer) if teacher_model is None else LocalTeacher(teacher_model)
    generation = build_student_generation(config, student_model, tokenizer)
    try:
        metrics = validate(generation, student_model, wrap_teacher(teacher, config, tokenizer),
                           make_eval_dataloader(examples, config.validation.batch_size), tokenizer, config)
    finally:
        close_generation(generation)
    log_dir = Path(config.logger.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "eval_metrics.json").write_text(
        json.dumps({"model_path": model_path, **metrics}, indent=2), encoding="utf-8"
    )
    for key, value in metrics.items():
        print(f"{key:<28} {value:.4f}")
    print(f"evaluated {model_path} on {len(examples)} prompts; written to {log_dir / 'eval_metrics.json'}")
    return metrics


# --------------------------------------------------------------------------- training loop

_CONSOLE_KEYS = [
    "train/loss", "train/kl_forward", "train/kl_reverse", "train/kl_reverse_estimate", "train/on_policy",
    "train/mean_response_length", "perf/tokens_per_s",
]


def distillation_train(
    student_policy: PolicyInterface,
    teacher_policy: TeacherInterface,
    student_generation: GenerationInterface | None,
    dataloader: StatefulDataLoader,
    val_dataloader: StatefulDataLoader | None,
    tokenizer: Any,
    loss_fn: LossFunction,
    logger: Logger,
    checkpointer: CheckpointManager,
    distillation_save_state: DistillationSaveState,
    master_config: MasterConfig,
) -> None:
    """Runs on-policy distillation until ``max_num_steps`` or ``num_epochs`` is reached.

    If ``distillation_save_state`` comes from a checkpoint (step > 0), the RNG streams,
    the λ coin and the data position are restored from that checkpoint first, so the
    remaining steps are exactly those of an uninterrupted run. SIGINT / SIGTERM finish
    the current step, write a checkpoint and return.

    Args:
        student_policy: the trainable student.
        teacher_policy: the frozen teacher (scores the very tokens the student trains on).
        student_generation: the sampling engine; None means the policy generates itself.
        dataloader: resumable loader of prepared training examples (lists of dicts).
        val_dataloader: validation examples, or None to skip validation.
        tokenizer: shared tokenizer of teacher and student.
        loss_fn: the distillation loss (called per micro-batch).
        logger: metric sink.
        checkpointer: writes ``step_N`` checkpoints.
        distillation_save_state: run counters (step, epoch, consumed samples, best metric).
        master_config: the validated run config.

    Raises:
        TrainingDivergedError: after ``max_consecutive_nonfinite_steps`` skipped steps.
    """
    config = master_config
    if student_generation is None:
        # NeMo-RL's convention: a policy that can sample (e.g. Megatron) generates itself.
        if not callable(getattr(student_policy, "generate", None)):
            raise ValueError("student_generation is None but the student policy has no generate() method")
        student_generation = student_policy  # type: ignore[assignment]
    generation: GenerationInterface = student_generation  # type: ignore[assignment]
    # A separate engine (e.g. vLLM) holds its own weights; they go stale after each update.
    generation_is_stale = bool(getattr(generation, "needs_refit", False))
    lambda_coin = random.Random(config.training.seed + 1)
    student_model = student_policy.model  # type: ignore[attr-defined]

    def train_step(examples: list[PreparedExample]) -> dict[str, Any]:
        nonlocal generation_is_stale
        step_start = time.perf_counter()
        timings: dict[str, float] = {}
        on_policy = lambda_coin.random() < config.distillation.lambda_
        if on_policy:
            if generation_is_stale:
                generation.refit(student_policy)  # type: ignore[attr-defined]
                timings["timing/refit"] = time.perf_counter() - step_start
            generation_start = time.perf_counter()
            batch = build_on_policy_batch(examples, generation, config)
            timings["timing/generation"] = time.perf_counter() - generation_start
        else:
            batch = build_fixed_data_batch(examples, tokenizer.pad_token_id, config.distillation.mask_prompt_tokens)
            timings["timing/generation"] = 0.0
        if on_policy and getattr(loss_fn, "adv_tau", 0.0) != 0.0:
            batch["task_reward"] = task_rewards(batch, examples, config.distillation.num_samples_per_prompt, tokenizer)
        train_start = time.perf_counter()
        query_teacher = getattr(loss_fn, "query_teacher", None)
        teacher_fn = (lambda micro_batch: query_teacher(teacher_policy, micro_batch)) if query_teacher else teacher_policy.get_logits
        train_metrics = student_policy.train(batch, loss_fn, teacher_fn=teacher_fn)
        train_seconds = time.perf_counter() - train_start
        teacher_seconds = teacher_policy.pop_seconds_spent()  # type: ignore[attr-defined]
        generation_is_stale = bool(getattr(generation, "needs_refit", False))
        timings["timing/teacher"] = teacher_seconds
        timings["timing/training"] = train_seconds - teacher_seconds
        step_seconds = time.perf_counter() - step_start
        timings["timing/step"] = step_seconds
        metrics: dict[str, Any] = {f"train/{key}": value for key, value in train_metrics.items()}
        metrics["train/on_policy"] = int(on_policy)
        if "task_reward" in batch:
            metrics["train/task_reward"] = float(batch["task_reward"].mean())
        metrics["train/mean_response_length"] = float(batch["response_lengths"].float().mean())
        metrics["train/truncation_rate"] = float(batch["truncated"].float().mean())
        metrics.update(timings)
        metrics["perf/tokens_per_s"] = float(batch["input_lengths"].sum()) / step_seconds
        metrics["perf/peak_memory_mb"] = _peak_memory_mb()
        return metrics

    def refresh_generation() -> None:
        nonlocal generation_is_stale
        generation.refit(student_policy)  # type: ignore[attr-defined]
        generation_is_stale = False

    def run_validation() -> dict[str, float]:
        if generation_is_stale:  # validation samples too: from the weights just trained
            refresh_generation()
        metrics = validate(generation, student_model, teacher_policy, val_dataloader, tokenizer, config)  # type: ignore[arg-type]
        teacher_policy.pop_seconds_spent()  # type: ignore[attr-defined]
        return metrics

    def baselines() -> None:
        """Once, on a fresh run: the teacher's answers (with its context, if any) and the eval baseline."""
        if val_dataloader is None or not (config.validation.teacher_baseline or config.validation.eval_baseline):
            return
        teacher_model = teacher_policy.model  # type: ignore[attr-defined]
        teacher_generation = HFGeneration(teacher_model, tokenizer, config.generation.decode_loop)
        with_context = config.distillation.teacher_context_spec() is not None
        prompt_key = "teacher_prompt_ids" if with_context else "prompt_ids"
        teacher_metrics = validate(teacher_generation, teacher_model, None, val_dataloader, tokenizer, config,
                                   prefix="val/teacher_", prompt_key=prompt_key)
        metrics = dict(teacher_metrics) if config.validation.teacher_baseline else {}
        if config.validation.eval_baseline:
            # The student as it starts, without the context; the teacher, with it.
            if generation_is_stale:
                refresh_generation()
            student_metrics = validate(generation, student_model, None, val_dataloader, tokenizer, config,
                                       prefix="val/student_")
            student_accuracy = student_metrics.get("val/student_accuracy")
            teacher_accuracy = teacher_metrics.get("val/teacher_accuracy")
            if student_accuracy is None or teacher_accuracy is None:
                log.warning("validation.eval_baseline: the validation data has no ground truth; no accuracies")
            else:
                metrics["val/baseline_student_accuracy"] = student_accuracy
                metrics["val/baseline_teacher_accuracy"] = teacher_accuracy
                metrics["val/baseline_accuracy_gap"] = teacher_accuracy - student_accuracy
        if metrics:
            logger.log_metrics(metrics, 0, console_keys=list(metrics))

    run_training_loop(
        policy=student_policy,
        tokenizer=tokenizer,
        dataloader=dataloader,
        logger=logger,
        checkpointer=checkpointer,
        state=distillation_save_state,  # type: ignore[arg-type]
        config=config,
        train_step=train_step,
        validate=run_validation if val_dataloader is not None else None,
        before_first_step=baselines,
        algorithm_rng=lambda_coin,
        console_keys=_CONSOLE_KEYS,
    )
