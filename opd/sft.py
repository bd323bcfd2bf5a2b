"""Supervised fine-tuning (SFT) on fixed chat data: configs, ``setup()``, ``sft_train()``.

The model learns the dataset's final assistant message by token-level NLL (prompt and padding carry no loss).
Everything but the step is shared with distillation: data, :class:`~opd.policy.hf_policy.HFPolicy`, validation,
checkpoints, resume and logs (:mod:`opd.run.training_loop`).

    opd sft --config examples/configs/sft.yaml [key.sub=value ...]
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pydantic import Field
from torchdata.stateful_dataloader import StatefulDataLoader

from opd.data.batches import build_fixed_data_batch
from opd.data.config import DataConfig
from opd.data.dataloaders import PreparedExample, make_eval_dataloader, make_train_dataloader
from opd.losses.nll import NLLLossFn
from opd.models.config import ModelLoadingConfig, StudentLoraSettings
from opd.models.interfaces import GenerationInterface, LossFunction
from opd.models.loading import check_output_sizes, load_causal_lm, resolve_device, resolve_dtype
from opd.policy.hf_policy import HFPolicy
from opd.rollout.hf_generation import HFGeneration
from opd.run.checkpoint import CheckpointingConfig, CheckpointManager
from opd.run.logger import Logger, LoggerConfig
from opd.run.run_setup import (
    load_examples,
    load_run_tokenizer,
    plan_run_length,
    report_overlap,
    restore_run,
)
from opd.run.training_loop import (
    NextBatch,
    RunConfig,
    RunParts,
    TrainingCallbacks,
    TrainingLoopConfig,
    check_output_is_fresh,
    find_resume_checkpoint,
    run_training_loop,
)
from opd.run.validation import ValidationConfig, validate
from opd.utils.errors import ConfigError

log = logging.getLogger("opd")


class SFTModelConfig(ModelLoadingConfig, StudentLoraSettings):
    """The model to fine-tune, how to load it, and (``lora``) whether to train LoRA adapters only."""

    model_path: str = Field(description="HF hub name, local model directory or tiny:<preset>")
    tokenizer_path: str | None = Field(None, description="defaults to model_path")


class SFTTrainingConfig(TrainingLoopConfig):
    """Loop, batch and optimizer settings of SFT (same meaning as in distillation)."""

    batch_size: int = Field(32, ge=1, description="sequences per optimizer step")
    micro_batch_size: int | None = Field(None, ge=1, description="sequences per forward/backward; null = batch_size")


class SFTMasterConfig(RunConfig):
    """The whole configuration of an SFT run."""

    output_dir: str = "results/sft"
    model: SFTModelConfig
    training: SFTTrainingConfig = Field(default_factory=SFTTrainingConfig)
    data: DataConfig
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = Field(
        default_factory=lambda: CheckpointingConfig(metric_name="val/accuracy", higher_is_better=True)
    )

    def has_validation_data(self) -> bool:
        """Whether ``data`` names validation data (a file or a holdout)."""
        return self.data.has_validation

    def model_loading(self) -> SFTModelConfig:
        return self.model

    def harness_comparisons(self) -> dict[str, str]:
        """The model before fine-tuning."""
        return {"student_before": self.model.model_path}


@dataclass
class SFTComponents(RunParts):
    """Everything :func:`sft_train` runs with: the shared loop's parts, and what a step and validation use."""

    generation: GenerationInterface
    val_dataloader: StatefulDataLoader | None
    loss_fn: LossFunction


def setup(master_config: SFTMasterConfig) -> SFTComponents:
    """Builds what ``sft_train`` needs; resumes from the newest checkpoint if there is one.

    Raises:
        ConfigError: a training example has no assistant answer, or the batch is larger than the data.
    """
    config = master_config
    checkpointer = CheckpointManager(config.checkpointing)
    check_output_is_fresh(config.output_dir, checkpointer)
    tokenizer = load_run_tokenizer(
        config.model.tokenizer_path or config.model.model_path, config.model.trust_remote_code, config.data
    )
    train_examples = load_examples(config.data, tokenizer, "train")
    missing = sum(example["response_ids"] is None for example in train_examples)
    if missing:
        raise ConfigError(
            f"SFT learns the final assistant message, but {missing} of {len(train_examples)} examples in "
            f"'{config.data.train_path}' have none"
        )
    _, total_steps = plan_run_length(
        len(train_examples),
        config.training.batch_size,
        config.training.num_epochs,
        config.training.max_num_steps,
        config.data.train_path,
    )
    val_examples = load_examples(config.data, tokenizer, "val") if config.data.has_validation else None
    report_overlap(train_examples, val_examples, config.data)

    resume_from = find_resume_checkpoint(config.checkpointing.enabled, checkpointer)
    lora = config.model.active_lora()
    # A LoRA run resumes from the base model plus the adapter kept in the optimizer state.
    model_path = str(resume_from / "policy") if resume_from is not None and lora is None else config.model.model_path
    device = resolve_device(config.model.device)
    model = load_causal_lm(model_path, resolve_dtype(config.model.dtype, device), device, config.model)
    check_output_sizes(model, len(tokenizer), model_path)

    micro_batch_size = config.training.micro_batch_size or config.training.batch_size
    policy = HFPolicy(model, config.training, micro_batch_size, total_steps, lora=lora, seed=config.training.seed)
    save_state = restore_run(resume_from, policy, checkpointer, config, total_steps)
    logger = Logger(config.logger, total_steps)
    logger.log_hyperparams(config.model_dump(mode="json", by_alias=True))
    log.info(
        "SFT of %s: %d train examples, %s val, %d steps",
        model_path,
        len(train_examples),
        len(val_examples) if val_examples else 0,
        total_steps,
    )
    return SFTComponents(
        policy=policy,
        tokenizer=tokenizer,
        dataloader=make_train_dataloader(
            train_examples, config.training.batch_size, config.data.shuffle, config.training.seed
        ),
        logger=logger,
        checkpointer=checkpointer,
        state=save_state,
        config=config,
        generation=HFGeneration(model, tokenizer),
        val_dataloader=make_eval_dataloader(val_examples, config.validation.batch_size) if val_examples else None,
        loss_fn=NLLLossFn(),
    )


def sft_train(components: SFTComponents) -> None:
    """Fine-tunes the policy on the dataset's assistant turns until the step budget is spent."""
    run_training_loop(components, SFTRun(components))


class SFTRun(TrainingCallbacks):
    """One SFT run: its components, and a step on the dataset's answers, and validation."""

    console_keys = ("train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_s")

    def __init__(self, components: SFTComponents) -> None:
        self.policy, self.generation, self.tokenizer = components.policy, components.generation, components.tokenizer
        self.val_dataloader, self.loss_fn = components.val_dataloader, components.loss_fn
        self.config = components.config

    def train_step(self, next_batch: NextBatch) -> tuple[int, dict[str, Any]]:
        """One optimizer step on the next batch's assistant turns (prompt tokens masked)."""
        examples: list[PreparedExample] = next_batch()
        start = time.perf_counter()
        batch = build_fixed_data_batch(examples, self.tokenizer.pad_token_id, mask_prompt_tokens=True)
        metrics = {f"train/{key}": value for key, value in self.policy.train(batch, self.loss_fn).items()}
        seconds = time.perf_counter() - start
        metrics["train/mean_response_length"] = float(batch["response_lengths"].float().mean())
        metrics["timing/step"] = seconds
        metrics["perf/tokens_per_s"] = float(batch["input_lengths"].sum()) / seconds
        return len(examples), metrics

    def validate(self) -> dict[str, float] | None:
        """Accuracy and lengths of the model's own answers (no teacher)."""
        if self.val_dataloader is None:
            return None
        return validate(
            self.generation,
            self.policy,
            None,
            self.val_dataloader,
            self.tokenizer,
            self.config.validation.generate_strategy,
        )
