"""On-policy knowledge distillation: configs, ``setup()``, ``distillation_train()``, ``validate()``.

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
``grpo_train`` does, so other generation engines and teachers plug in unchanged.
"""

from __future__ import annotations

import logging
import math
import random
import resource
import time
from pathlib import Path
from typing import Any, Literal, TypedDict

import numpy as np
import torch
from pydantic import Field
from torchdata.stateful_dataloader import StatefulDataLoader

from opd.algorithms.interfaces import LossFunction
from opd.algorithms.loss_functions import DistillationLossFn, shift_token_mask, token_kl
from opd.data.batched_data_dict import BatchedDataDict
from opd.data.config import DataConfig
from opd.data.datasets import load_chat_dataset, split_prompt_and_response
from opd.data.sequences import (
    attention_mask_from_lengths,
    build_token_mask,
    encode_prompt,
    encode_response,
    pack_sequences,
)
from opd.environments.math_verifier import is_correct
from opd.models.config import ModelConfig
from opd.models.generation.config import GenerateStrategyConfig
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
from opd.models.policy.hf_policy import HFPolicy, OptimizerConfig
from opd.models.teacher.local_teacher import LocalTeacher
from opd.utils.checkpoint import CheckpointingConfig, CheckpointManager
from opd.utils.config import StrictConfig, config_to_yaml
from opd.utils.errors import ConfigError, DataError
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


class TrainingConfig(OptimizerConfig):
    """Loop, batch and optimizer settings (the specification's §4.3 keys)."""

    batch_size: int = Field(8, ge=1, description="prompts per optimizer step")
    micro_batch_size: int | None = Field(None, ge=1, description="sequences per forward/backward pass")
    gradient_accumulation_steps: int | None = Field(None, ge=1, description="micro-batches per optimizer step")
    num_epochs: int = Field(1, ge=1)
    max_num_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    val_freq: int = Field(0, ge=0, description="validate every N steps; 0 disables periodic validation")
    save_freq: int = Field(0, ge=0, description="checkpoint every N steps; 0 saves only at the end")
    seed: int = 42


class ValidationConfig(StrictConfig):
    """How validation generates and what it reports."""

    val_at_start: bool = True
    val_at_end: bool = True
    batch_size: int = Field(16, ge=1, description="prompts per validation generation batch")
    generate_strategy: GenerateStrategyConfig = Field(
        default_factory=lambda: GenerateStrategyConfig(decoding_method="greedy"),
        description="the student's decoding for validation (greedy by default)",
    )


class MasterConfig(StrictConfig):
    """The whole run's configuration (one YAML file)."""

    output_dir: str = Field("results/distillation", description="final model, logs and checkpoints go here")
    model: ModelConfig
    distillation: DistillationConfig = Field(default_factory=DistillationConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    data: DataConfig
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
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


class DistillationSaveState(TypedDict):
    """Counters saved in every checkpoint and restored on resume."""

    step: int
    epoch: int
    consumed_samples: int
    best_metric: float | None


def _default_save_state() -> DistillationSaveState:
    return {"step": 0, "epoch": 0, "consumed_samples": 0, "best_metric": None}


# --------------------------------------------------------------------------- data


class PreparedExample(TypedDict):
    """A tokenized example: the prompt ids, the fixed response ids, the ground truth."""

    prompt_ids: list[int]
    response_ids: list[int] | None
    ground_truth: str | None


def prepare_examples(
    examples: list[dict], tokenizer: Any, max_prompt_length: int | None, source: str
) -> list[PreparedExample]:
    """Applies the chat template and tokenizes; drops prompts longer than the limit.

    Raises:
        DataError: if every prompt is over ``max_prompt_length``.
    """
    prepared: list[PreparedExample] = []
    for example in examples:
        prompt_messages, response = split_prompt_and_response(example["messages"])
        prompt_ids = encode_prompt(tokenizer, prompt_messages)
        if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
            continue
        response_ids = encode_response(tokenizer, prompt_messages, response) if response else None
        ground_truth = example.get("ground_truth")
        prepared.append(
            PreparedExample(
                prompt_ids=prompt_ids,
                response_ids=response_ids,
                ground_truth=None if ground_truth is None else str(ground_truth),
            )
        )
    skipped = len(examples) - len(prepared)
    if skipped:
        log.warning("%s: skipped %d of %d prompts longer than data.max_prompt_length", source, skipped, len(examples))
    if not prepared:
        raise DataError(f"{source}: no prompt fits data.max_prompt_length = {max_prompt_length}")
    return prepared


def _collate_examples(examples: list[PreparedExample]) -> list[PreparedExample]:
    """Keeps a batch as a list: prompts have different lengths and are padded later."""
    return examples


def make_dataloader(
    examples: list[PreparedExample], batch_size: int, shuffle: bool, seed: int, drop_last: bool
) -> StatefulDataLoader:
    """A resumable dataloader (its ``state_dict`` goes into checkpoints)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return StatefulDataLoader(
        examples,  # a list is a map-style dataset
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        collate_fn=_collate_examples,
        generator=generator,
        num_workers=0,
    )


# --------------------------------------------------------------------------- setup


def set_seed(seed: int) -> None:
    """Seeds Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_config_against_data(config: MasterConfig, train_examples: list[PreparedExample]) -> None:
    """Cross-checks that need the data: λ < 1 needs fixed responses to train on."""
    if config.distillation.lambda_ < 1.0:
        missing = sum(example["response_ids"] is None for example in train_examples)
        if missing:
            raise ConfigError(
                f"distillation.lambda = {config.distillation.lambda_} uses fixed data on some steps, but "
                f"{missing} of {len(train_examples)} examples in '{config.data.train_path}' have no final "
                "assistant message; add responses or set distillation.lambda = 1.0"
            )


def check_output_is_fresh(config: MasterConfig) -> None:
    """Refuses to start a fresh run over the final model or checkpoints of an earlier one.

    Resuming is not implemented yet, so a fresh run would overwrite ``step_N``
    directories or ``final_model/`` that hold earlier work; stopping is the safe choice.

    Raises:
        ConfigError: naming the checkpoint directory and the newest checkpoint in it.
    """
    final_model = Path(config.output_dir) / "final_model"
    if final_model.exists():
        raise ConfigError(
            f"output_dir '{config.output_dir}' already holds final_model/ from an earlier run; choose another "
            "output_dir or move it away. Nothing was changed."
        )
    if not config.checkpointing.enabled:
        return
    latest = CheckpointManager(config.checkpointing).latest_checkpoint()
    if latest is not None:
        raise ConfigError(
            f"checkpointing.checkpoint_dir '{config.checkpointing.checkpoint_dir}' already holds {latest.name} "
            "from an earlier run; choose another output_dir (or checkpointing.checkpoint_dir), or move the "
            "old checkpoints away. Nothing was changed."
        )


def setup(master_config: MasterConfig) -> tuple:
    """Builds everything ``distillation_train`` needs, checking user input first.

    Order matters: data files are read and validated before any model is loaded, so a
    malformed line fails in seconds, not after loading a 32B teacher.

    Returns:
        ``(student_policy, teacher_policy, student_generation, dataloader,
        val_dataloader, tokenizer, loss_fn, logger, checkpointer,
        distillation_save_state, master_config)``.
    """
    config = master_config
    micro_batch_size, _ = resolve_micro_batching(config)
    check_output_is_fresh(config)
    set_seed(config.training.seed)

    tokenizer_path = config.model.tokenizer_path or config.model.student_model_path
    tokenizer = load_tokenizer(tokenizer_path, config.model.trust_remote_code)
    if config.data.chat_template:
        tokenizer.chat_template = config.data.chat_template

    data_kwargs = {"data_format": config.data.data_format, "prompt_file": config.data.prompt_file}
    train_raw = load_chat_dataset(
        config.data.train_path, split=config.data.train_split, max_examples=config.data.max_train_examples, **data_kwargs
    )
    train_examples = prepare_examples(train_raw, tokenizer, config.data.max_prompt_length, config.data.train_path)
    check_config_against_data(config, train_examples)
    if len(train_examples) < config.training.batch_size:
        raise ConfigError(
            f"training.batch_size = {config.training.batch_size} exceeds the {len(train_examples)} "
            f"usable examples in '{config.data.train_path}'"
        )
    val_examples = None
    if config.data.val_path:
        val_raw = load_chat_dataset(
            config.data.val_path, split=config.data.val_split, max_examples=config.data.max_val_examples, **data_kwargs
        )
        val_examples = prepare_examples(val_raw, tokenizer, config.data.max_prompt_length, config.data.val_path)

    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    # The teacher's own tokenizer is checked even when model.tokenizer_path overrides the
    # student's: the teacher's logits are indexed by the ids its tokenizer defines.
    teacher_tokenizer = load_tokenizer(config.model.teacher_model_path, config.model.trust_remote_code)
    check_tokenizer_compatibility(
        tokenizer, teacher_tokenizer, config.model.student_model_path, config.model.teacher_model_path
    )
    log.info("loading student %s and teacher %s (%s on %s)", config.model.student_model_path,
             config.model.teacher_model_path, str(dtype).replace("torch.", ""), device)
    student_model = load_causal_lm(config.model.student_model_path, dtype, device, config.model)
    teacher_model = load_causal_lm(config.model.teacher_model_path, dtype, device, config.model)
    vocab_size = len(tokenizer)
    check_output_sizes(student_model, vocab_size, config.model.student_model_path)
    check_output_sizes(teacher_model, vocab_size, config.model.teacher_model_path)

    steps_per_epoch = len(train_examples) // config.training.batch_size
    total_steps = steps_per_epoch * config.training.num_epochs
    if config.training.max_num_steps is not None:
        total_steps = min(total_steps, config.training.max_num_steps)

    student_policy = HFPolicy(student_model, config.training, micro_batch_size, total_steps)
    teacher_policy = LocalTeacher(teacher_model)
    student_generation = HFGeneration(student_model, tokenizer)
    dataloader = make_dataloader(
        train_examples, config.training.batch_size, config.data.shuffle, config.training.seed, drop_last=True
    )
    val_dataloader = (
        make_dataloader(val_examples, config.validation.batch_size, False, config.training.seed, drop_last=False)
        if val_examples
        else None
    )
    loss_fn = DistillationLossFn(
        kl_type=config.distillation.kl_type,
        mixed_kl_weight=config.distillation.mixed_kl_weight,
        temperature=config.distillation.kl_temperature,
        kl_reduction=config.distillation.kl_reduction,
        vocab_size=vocab_size,
    )
    logger = Logger(config.logger, total_steps)
    checkpointer = CheckpointManager(config.checkpointing)
    save_state = _default_save_state()
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
    return batch


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
        )
    finally:
        student_generation.finish_generation()
    batch["token_mask"] = build_token_mask(
        batch["input_lengths"], batch["prompt_lengths"], batch["input_ids"].shape[1],
        config.distillation.mask_prompt_tokens,
    )
    return batch


def _peak_memory_mb() -> float:
    """Peak resident memory of this process (CPU) or peak allocated GPU memory, in MiB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# --------------------------------------------------------------------------- validation


def validate(
    student_generation: GenerationInterface,
    student_model: torch.nn.Module,
    teacher_policy: TeacherInterface,
    val_dataloader: StatefulDataLoader,
    tokenizer: Any,
    master_config: MasterConfig,
) -> dict[str, float]:
    """Student generates on the validation prompts; reports accuracy, KL and lengths.

    Returns:
        ``val/kl_forward`` and ``val/kl_reverse`` (token means over the generated
        responses, teacher vs student), ``val/mean_response_length``,
        ``val/truncation_rate``, and ``val/accuracy`` when the data has ground truth.
    """
    strategy = master_config.validation.generate_strategy
    vocab_size = len(tokenizer)
    totals = {"kl_forward": 0.0, "kl_reverse": 0.0, "tokens": 0.0, "length": 0.0, "truncated": 0.0}
    correct, graded, rows = 0, 0, 0
    student_device = next(student_model.parameters()).device
    for examples in val_dataloader:
        student_generation.prepare_for_generation()
        try:
            batch = student_generation.generate([example["prompt_ids"] for example in examples], strategy, 1)
        finally:
            student_generation.finish_generation()
        batch["token_mask"] = build_token_mask(
            batch["input_lengths"], batch["prompt_lengths"], batch["input_ids"].shape[1], True
        )
        teacher_logits = teacher_policy.get_logits(batch)[..., :vocab_size]
        with torch.inference_mode():
            input_ids = batch["input_ids"].to(student_device)
            attention = attention_mask_from_lengths(batch["input_lengths"].to(student_device), input_ids.shape[1])
            student_logits = student_model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
            mask = shift_token_mask(batch["token_mask"]).bool().to(student_device)
            student_rows = student_logits[:, :-1][..., :vocab_size][mask]
            teacher_rows = teacher_logits[:, :-1].to(student_device)[mask]
            totals["kl_forward"] += float(token_kl(student_rows, teacher_rows, "forward").sum())
            totals["kl_reverse"] += float(token_kl(student_rows, teacher_rows, "reverse").sum())
            totals["tokens"] += float(mask.sum())
        totals["length"] += float(batch["response_lengths"].sum())
        totals["truncated"] += float(batch["truncated"].sum())
        rows += batch.size
        for row, example in enumerate(examples):
            if example["ground_truth"] is None:
                continue
            start, end = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
            response = tokenizer.decode(batch["input_ids"][row, start:end], skip_special_tokens=True)
            correct += is_correct(response, example["ground_truth"])
            graded += 1
    tokens = max(totals["tokens"], 1.0)
    metrics = {
        "val/kl_forward": totals["kl_forward"] / tokens,
        "val/kl_reverse": totals["kl_reverse"] / tokens,
        "val/mean_response_length": totals["length"] / max(rows, 1),
        "val/truncation_rate": totals["truncated"] / max(rows, 1),
    }
    if graded:
        metrics["val/accuracy"] = correct / graded
    return metrics


# --------------------------------------------------------------------------- training loop

_CONSOLE_KEYS = [
    "train/loss", "train/kl_forward", "train/kl_reverse", "train/on_policy",
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
    """
    config = master_config
    state = distillation_save_state
    if student_generation is None:
        # NeMo-RL's convention: a policy that can sample (e.g. Megatron) generates itself.
        if not callable(getattr(student_policy, "generate", None)):
            raise ValueError("student_generation is None but the student policy has no generate() method")
        student_generation = student_policy  # type: ignore[assignment]
    # A separate engine (e.g. vLLM) holds its own weights; they go stale after each update.
    generation_is_stale = bool(getattr(student_generation, "needs_refit", False))
    lambda_coin = random.Random(config.training.seed + 1)
    total_steps = logger.total_steps
    pad_token_id = tokenizer.pad_token_id
    student_model = student_policy.model  # type: ignore[attr-defined]

    def run_validation(step: int) -> None:
        if val_dataloader is None:
            return
        start = time.perf_counter()
        metrics = validate(student_generation, student_model, teacher_policy, val_dataloader, tokenizer, config)
        metrics["timing/validation"] = time.perf_counter() - start
        teacher_policy.pop_seconds_spent()  # type: ignore[attr-defined]
        logger.log_metrics(metrics, step, console_keys=[k for k in metrics if k.startswith("val/")])

    if state["step"] == 0 and config.validation.val_at_start:
        run_validation(0)

    done = state["step"] >= total_steps
    while not done and state["epoch"] < config.training.num_epochs:
        for examples in dataloader:
            step_start = time.perf_counter()
            timings: dict[str, float] = {}
            on_policy = lambda_coin.random() < config.distillation.lambda_
            phase_start = time.perf_counter()
            if on_policy:
                if generation_is_stale:
                    student_generation.refit(student_policy)  # type: ignore[attr-defined]
                    generation_is_stale = False
                batch = build_on_policy_batch(examples, student_generation, config)
                timings["timing/generation"] = time.perf_counter() - phase_start
            else:
                batch = build_fixed_data_batch(examples, pad_token_id, config.distillation.mask_prompt_tokens)
                timings["timing/generation"] = 0.0
            train_start = time.perf_counter()
            train_metrics = student_policy.train(batch, loss_fn, teacher_logits_fn=teacher_policy.get_logits)
            train_seconds = time.perf_counter() - train_start
            teacher_seconds = teacher_policy.pop_seconds_spent()  # type: ignore[attr-defined]
            generation_is_stale = bool(getattr(student_generation, "needs_refit", False))
            timings["timing/teacher"] = teacher_seconds
            timings["timing/training"] = train_seconds - teacher_seconds

            state["step"] += 1
            state["consumed_samples"] += len(examples)
            step_seconds = time.perf_counter() - step_start
            timings["timing/step"] = step_seconds
            metrics: dict[str, Any] = {f"train/{key}": value for key, value in train_metrics.items()}
            metrics["train/on_policy"] = int(on_policy)
            metrics["train/mean_response_length"] = float(batch["response_lengths"].float().mean())
            metrics["train/truncation_rate"] = float(batch["truncated"].float().mean())
            metrics["train/epoch"] = state["epoch"]
            metrics.update(timings)
            metrics["perf/tokens_per_s"] = float(batch["input_lengths"].sum()) / step_seconds
            metrics["perf/peak_memory_mb"] = _peak_memory_mb()
            logger.log_metrics(metrics, state["step"], console_keys=_CONSOLE_KEYS)

            step = state["step"]
            is_last = step >= total_steps
            if config.training.val_freq and step % config.training.val_freq == 0 and not is_last:
                run_validation(step)
            if config.checkpointing.enabled and config.training.save_freq and step % config.training.save_freq == 0 and not is_last:
                save_checkpoint(student_policy, tokenizer, checkpointer, state, dataloader, lambda_coin, config)
            if is_last:
                done = True
                break
        else:
            state["epoch"] += 1

    if config.validation.val_at_end:
        run_validation(state["step"])
    if config.checkpointing.enabled:
        save_checkpoint(student_policy, tokenizer, checkpointer, state, dataloader, lambda_coin, config)
    final_dir = Path(config.output_dir) / "final_model"
    student_policy.save_pretrained(str(final_dir), tokenizer=tokenizer)  # type: ignore[call-arg]
    log.info("final student written to %s", final_dir)
    logger.close()


def save_checkpoint(
    student_policy: Any,
    tokenizer: Any,
    checkpointer: CheckpointManager,
    state: DistillationSaveState,
    dataloader: StatefulDataLoader,
    lambda_coin: random.Random,
    config: MasterConfig,
) -> Path:
    """Writes ``step_N`` with the model, optimizer, RNG states and dataloader position."""
    start = time.perf_counter()
    training_state = {
        "dataloader": dataloader.state_dict(),
        "rng_python": random.getstate(),
        "rng_numpy": np.random.get_state(),
        "rng_torch": torch.get_rng_state(),
        "rng_lambda_coin": lambda_coin.getstate(),
    }
    path = checkpointer.save(
        state["step"], student_policy, tokenizer, dict(state), _to_plain(training_state), config_to_yaml(config)
    )
    log.info("checkpoint %s written in %.1fs", path, time.perf_counter() - start)
    return path


def _to_plain(value: Any) -> Any:
    """Makes RNG states loadable with ``torch.load(weights_only=True)`` (tuples/arrays → lists/tensors)."""
    if isinstance(value, dict):
        return {key: _to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(item) for item in value]
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    return value
