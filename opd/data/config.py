"""The ``data`` section of a config: where the training and validation data come from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

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
    val_holdout: int | None = Field(
        None,
        ge=1,
        description="validate on this many rows drawn from the training data, which training then never sees "
        "(for a dataset with one split; needs val_path: null)",
    )
    val_holdout_seed: int = Field(0, description="which rows val_holdout draws (the same for every training.seed)")
    shuffle: bool = True

    @model_validator(mode="after")
    def _one_validation_source(self) -> DataConfig:
        if self.val_holdout is not None and self.val_path is not None:
            raise ValueError(
                f"data.val_holdout = {self.val_holdout} validates on rows held out of data.train_path, but "
                f"data.val_path = '{self.val_path}' names another source; set one of them to null"
            )
        return self

    @property
    def has_validation(self) -> bool:
        """Whether the section names validation data (a file or a holdout)."""
        return self.val_path is not None or self.val_holdout is not None
