"""Start-up steps that distillation and SFT share: tokenizer, data, run length, resume.

Data comes before any model loads, so a malformed line fails in seconds.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Literal, cast

from opd.data.config import DataConfig
from opd.data.dataloaders import PreparedExample, ToolsOf, prepare_examples
from opd.data.datasets import load_chat_dataset
from opd.data.teacher_choice import TeacherChoice
from opd.data.teacher_context import TeacherContext
from opd.models.interfaces import PolicyInterface
from opd.models.loading import load_tokenizer
from opd.run.checkpoint import CheckpointManager, reading_checkpoint
from opd.run.training_loop import RunSaveState, fresh_save_state, warn_on_config_change
from opd.utils.config import StrictConfig
from opd.utils.errors import ConfigError

log = logging.getLogger("opd")


def load_run_tokenizer(path: str, trust_remote_code: bool, data: DataConfig) -> Any:
    """The run's tokenizer, with ``data.chat_template`` replacing its own template when set."""
    return load_tokenizer(path, trust_remote_code, data.chat_template)


def load_examples(
    data: DataConfig,
    tokenizer: Any,
    split: Literal["train", "val"],
    teacher_context: TeacherContext | None = None,
    path: str | None = None,
    teacher_choice: TeacherChoice | None = None,
    teacher_tokenizer: Any | None = None,
    tools: list[dict] | ToolsOf | None = None,
) -> list[PreparedExample]:
    """Reads, checks and tokenizes the training or validation data of ``data``.

    With ``data.val_holdout``, validation is that many training rows (:func:`holdout_rows`); training gets the rest.
    ``path`` replaces the section's file (``opd eval`` on a test split); ``teacher_tokenizer`` renders the teacher's
    prompts in cross-tokenizer mode; ``tools`` are listed in every prompt (a function: each example's own, see
    :func:`prepare_examples`).
    """
    validation = split == "val"
    if validation:
        source, hf_split, limit = data.val_path, data.val_split, data.max_val_examples
    else:
        source, hf_split, limit = data.train_path, data.train_split, data.max_train_examples
    if path is None and data.val_holdout is not None:
        rows = load_chat_dataset(
            data.train_path, split=data.train_split, data_format=data.data_format, prompt_file=data.prompt_file
        )
        held_out = holdout_rows(len(rows), data.val_holdout, data.val_holdout_seed, data.train_path)
        rows = [row for index, row in enumerate(rows) if (index in held_out) == validation]
        rows = rows[:limit] if limit else rows
        source = f"{data.train_path} ({'held-out validation' if validation else 'training'} rows)"
    else:
        source = path if path is not None else source
        if source is None:
            raise ConfigError(
                f"no {split} data: set data.{split}_path" + (" or data.val_holdout" if validation else "")
            )
        rows = load_chat_dataset(
            source, split=hf_split, max_examples=limit, data_format=data.data_format, prompt_file=data.prompt_file
        )
    return prepare_examples(
        rows, tokenizer, data.max_prompt_length, source, teacher_context, teacher_choice, teacher_tokenizer, tools
    )


def holdout_rows(num_rows: int, holdout: int, seed: int, source: str) -> set[int]:
    """The indices of the ``holdout`` validation rows, set by ``seed`` and ``num_rows`` alone (own generator).

    Raises:
        ConfigError: if the holdout would leave no training rows.
    """
    if holdout >= num_rows:
        raise ConfigError(
            f"data.val_holdout = {holdout} would hold out every one of the {num_rows} rows of '{source}'; "
            "use fewer validation rows"
        )
    return set(random.Random(seed).sample(range(num_rows), holdout))


def report_overlap(train: list[PreparedExample], val: list[PreparedExample] | None, data: DataConfig) -> int:
    """Warns when validation prompts (compared as token ids) also appear in the training data; returns their count."""
    if not val:
        return 0
    train_prompts = {tuple(example["prompt_ids"]) for example in train}
    overlap = sum(tuple(example["prompt_ids"]) in train_prompts for example in val)
    if overlap:
        log.warning(
            "%d of the %d validation prompts also appear in the training data (%s vs %s); validation then "
            "measures memorisation too (data.val_holdout carves a disjoint validation set out of one source)",
            overlap,
            len(val),
            data.val_path,
            data.train_path,
        )
    return overlap


def plan_run_length(
    num_examples: int, batch_size: int, num_epochs: int, max_num_steps: int | None, train_path: str
) -> tuple[int, int]:
    """``(steps_per_epoch, total_steps)``: whole batches per epoch, cut at ``max_num_steps``.

    Raises:
        ConfigError: if the batch is larger than the data.
    """
    if num_examples < batch_size:
        raise ConfigError(
            f"training.batch_size = {batch_size} exceeds the {num_examples} usable examples in '{train_path}'"
        )
    steps_per_epoch = num_examples // batch_size
    total_steps = steps_per_epoch * num_epochs
    return steps_per_epoch, total_steps if max_num_steps is None else min(total_steps, max_num_steps)


def restore_run(
    resume_from: Path | None,
    policy: PolicyInterface,
    checkpointer: CheckpointManager,
    config: StrictConfig,
    total_steps: int,
) -> RunSaveState:
    """The run's counters: fresh, or ``resume_from``'s with the optimizer restored (the loop restores RNG and data)."""
    if resume_from is None:
        return fresh_save_state()
    warn_on_config_change(resume_from, config)
    with reading_checkpoint(resume_from):
        policy.load_checkpoint(resume_from)
        # Counters a checkpoint predates keep their fresh values.
        save_state = cast(RunSaveState, {**fresh_save_state(), **checkpointer.load_save_state(resume_from)})
    checkpointer.protected_step = save_state["best_step"]
    log.info("resuming from %s (step %d of %d)", resume_from, save_state["step"], total_steps)
    return save_state
