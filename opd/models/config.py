"""Which models to load and how (the ``model`` section of a config)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from opd.utils.config import StrictConfig


class ModelLoadingConfig(StrictConfig):
    """How models are loaded, shared by every algorithm's ``model`` section."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    trust_remote_code: bool = False
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = None


class ModelConfig(ModelLoadingConfig):
    """Teacher, student and tokenizer locations plus loading options.

    Paths are Hugging Face hub names, local model directories, or ``tiny:<preset>``
    for the locally built tiny models of :mod:`opd.models.tiny`.
    """

    teacher_model_path: str = Field(description="teacher: hub name, local directory or tiny:<preset>")
    student_model_path: str = Field(description="student: hub name, local directory or tiny:<preset>")
    tokenizer_path: str | None = Field(None, description="defaults to student_model_path")
