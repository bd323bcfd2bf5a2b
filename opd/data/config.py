"""The ``data`` section of a config: where the training and validation data come from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from opd.utils.config import StrictConfig


class DataConfig(StrictConfig):
    """Training / validation datasets and how they are prepared."""

    train_path: str = Field(description="jsonl / json / parquet file, saved HF dataset dir, or hub name")
    train_split: str = "train"
    val_path: str | None = Field(None, description="validation data; null disables validation")
    val_split: str = "train"
    data_format: Literal["chat", "math_cl"] = Field(
        "chat", description="chat: {'messages': [...]}; math_cl: {'problem', 'ground_truth_answer'}"
    )
    prompt_file: str | None = Field(None, description="prompt template with {prompt}, for data_format=math_cl")
    chat_template: str | None = Field(None, description="Jinja chat template overriding the tokenizer's")
    max_prompt_length: int | None = Field(None, ge=1, description="longer prompts are skipped (counted in the log)")
    max_train_examples: int | None = Field(None, ge=1)
    max_val_examples: int | None = Field(None, ge=1)
    shuffle: bool = True
